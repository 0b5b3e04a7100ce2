"""API dialects over one engine path: each a parser and a renderer for api/exchange.py's Exchange.

=====================  ==============================================================================
``openai.py``          ``POST /v1/chat/completions``, ``/v1/completions``: api.protocol's parser; chunks and
                       the full response
``responses.py``       ``POST /v1/responses``: body -> chat request, events -> Response object / SSE events,
                       the bounded ``store`` of finished responses (``previous_response_id``)
``anthropic.py``       ``POST /v1/messages`` (+ ``/count_tokens``): body -> chat request, events -> Message /
                       SSE events, Anthropic-shaped errors
``events.py``          the events of one choice (text, reasoning, tool calls, finish) both of those render
=====================  ==============================================================================

Responses and Messages translate their body in one pass into an OpenAI chat body that
api.protocol.RequestParser.chat turns into the internal GenerationRequest (template, tools plan, grammar, sampling,
stop); errors it raises are renamed to the dialect's own field names. A dialect never admits, records or touches a
socket: api/exchange.py does, once for all of them. Plain synchronous code.
"""
