// One warp-wide tensor-core MMA, m16n8k16, for numba.cuda kernels (gpu/kernels/mma.py links this file).
//
// D[16x8] (f32) = A[16x16] (bf16 or f16, row-major) * B[16x8] (same type, column-major) + C[16x8] (f32)
// Each lane passes its fragment registers (two 16-bit values per 32-bit register, the lower index in the low
// half) and gets its four D values back. Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
// g = lane / 4, t = lane % 4;
//   a0: A[g][2t..2t+1]   a1: A[g+8][2t..2t+1]   a2: A[g][2t+8..2t+9]   a3: A[g+8][2t+8..2t+9]
//   b0: B[2t..2t+1][g]   b1: B[2t+8..2t+9][g]
//   c0, c1: C[g][2t], C[g][2t+1]                 c2, c3: C[g+8][2t], C[g+8][2t+1]
// numba's device-function ABI: the return value through the first pointer, an int status (always 0).
// sm_80 and newer (Ampere, Hopper).

struct pd_f32x4 {
    float x, y, z, w;
};

// PD_MMA(NAME, TYPE): the device function NAME for 16-bit inputs TYPE ("bf16" or "f16")
#define PD_MMA(NAME, TYPE)                                                                                  \
    extern "C" __device__ int NAME(pd_f32x4* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,         \
                                   unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {      \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                          \
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"                   \
                     : "=f"(d->x), "=f"(d->y), "=f"(d->z), "=f"(d->w)                                        \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2),      \
                       "f"(c3));                                                                             \
        return 0;                                                                                            \
    }

PD_MMA(pd_mma_bf16_m16n8k16, "bf16")
PD_MMA(pd_mma_f16_m16n8k16, "f16")
