// mma.cuh: bf16 tensor-core helpers shared by attention_flash.cu (the prefill's flash attention) and attention_tc.cu
// (decode and tree verify on tensor cores): round-to-nearest-even packing, ldmatrix and mma.sync m16n8k16.
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, c = lane % 4):
//   A 16x16 row-major: a0 (row g, k 2c, 2c+1), a1 (row g+8, k 2c, 2c+1), a2 (row g, k 2c+8, +9), a3 (row g+8, k 2c+8, +9);
//   B 16x8 "col":      b0 (k 2c, 2c+1, col g), b1 (k 2c+8, 2c+9, col g);
//   C/D 16x8 fp32:     d0, d1 (row g, cols 2c, 2c+1), d2, d3 (row g+8, cols 2c, 2c+1).
// Each element of D is computed from its own row of A and column of B (and its C): a row's result never depends on
// the other rows of the tile.
// History: v1 (moved out of attention_flash.cu).

// Two floats as bf16x2 bits, rounded to nearest even: `lo` in the low half (the lower k / column index).
__device__ __forceinline__ u32 pack_bf16_rn(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
