"""API dialects over one engine path: OpenAI Responses and Anthropic Messages beside chat/completions.

=====================  ==============================================================================
``events.py``          the shared engine events of one admitted sequence (text, tool calls, finish, usage),
                       built from api.app.generate_text and api.tools.ToolDeltas, and their collection
``responses.py``       ``POST /v1/responses``: body -> chat request, events -> Response object / SSE events,
                       the bounded ``store`` of finished responses (``previous_response_id``)
``anthropic.py``       ``POST /v1/messages`` (+ ``/count_tokens``): body -> chat request, events -> Message /
                       SSE events, Anthropic-shaped errors
``routes.py``          the HTTP handlers of both, over api.app.Routes (admission, metrics, abort on disconnect)
=====================  ==============================================================================

Each dialect translates its body in one pass into an OpenAI chat body that api.protocol.RequestParser.chat turns
into the internal GenerationRequest (template, tools plan, grammar, sampling, stop); errors it raises are renamed
to the dialect's own field names. Plain synchronous code except events.py and routes.py.
"""
