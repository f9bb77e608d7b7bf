/* specexport.kernels::MatMulRows4: y = x @ W.T for 4-bit weights, with the rows of a call cheap and independent.

Why: ONNX Runtime's MatMulNBits unpacks each 4-bit weight tile again for every two rows, so 16 rows cost ~5x one
row, and speculation and batching both rest on extra rows being cheap. Here each tile of 16 output columns by 32
inputs is unpacked once per call into registers and then multiplied with every row of the call.

Exact per row: each row's activations are quantized alone (int8, one scale per block of 32 inputs, as
MatMulNBits' accuracy_level 4 does), the block products are integers, and each output accumulates its blocks in
the same order with the same float operations whatever the number of rows, the thread split or the instruction
set (AVX-512 VNNI, AVX2 and plain C give the same bits): a row's result never depends on the call's other rows.

Inputs: x float [..., K]; w uint8 [N/16, K/32, 256] (see pack order below); scales float [N/16, K/32, 16]; zeros
uint8 [N/16, K/32, 16] (w = (q - zero) * scale, the 16 columns of a tile together; N/16 rounded up, the last tile's
columns past N zero weights, never written out). Attributes K, N (K a multiple of 32). Output float [..., N].

Packed order of one (tile of 16 columns, block of 32 inputs): 4 runs of 64 bytes; byte 4 * c + j of run p holds
q[column c, input 8p + j] in its low nibble and q[column c, input 8p + 4 + j] in its high nibble (j < 4), so the
low and the high nibbles of a run are each 16 lanes of 4 consecutive inputs: what a VNNI dot product takes.

Example: exporter/kernels/__init__.py packs a weight and builds this file into the bundle's libspecexport_rows.so;
the runtime registers it with SessionOptions.register_custom_ops_library. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ROWS_X86 1
#endif

#define BLOCK 32
#define TILE 16
#define TILE_BYTES (TILE * BLOCK / 2)
#define ROW_CHUNK 64 /* rows accumulated at once per tile: 4 KiB of outputs on the stack */

typedef struct {
  int64_t k, n;
} Kernel;

/* One call's shared state: the rows quantized, the weights, where the outputs go. */
typedef struct {
  const int8_t *xq;   /* [m, k] */
  const float *xs;    /* [m, k / 32] row scales */
  const int32_t *xsum; /* [m, k / 32] sums of each block's codes */
  const uint8_t *w;
  const float *scales;
  const uint8_t *zeros;
  float *y;
  int64_t m, k, n;
  void (*tile)(const void *, size_t);
} Call;

/* One block of 32 of a row as int8 codes: its scale (max |x| / 127) and the codes' sum. Rounding to nearest even
   (nearbyintf; the vector conversion below rounds the same way), so both versions give the same codes. */
static void quantize_block_c(const float *v, int8_t *q, float *scale, int32_t *sum) {
  float top = 0.0f;
  for (int i = 0; i < BLOCK; i++) top = fmaxf(top, fabsf(v[i]));
  float inv = top > 0.0f ? 127.0f / top : 0.0f;
  int32_t total = 0;
  for (int i = 0; i < BLOCK; i++) {
    int32_t code = (int32_t)nearbyintf(v[i] * inv);
    code = code > 127 ? 127 : (code < -127 ? -127 : code);
    q[i] = (int8_t)code;
    total += code;
  }
  *scale = top / 127.0f;
  *sum = total;
}

#ifdef ROWS_X86
__attribute__((target("avx2,fma"))) static void quantize_block_avx2(const float *v, int8_t *q, float *scale,
                                                                     int32_t *sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
  float most = _mm_cvtss_f32(half);
  __m256 inv = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
  __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), total = _mm256_setzero_si256();
  int32_t codes[32];
  for (int i = 0; i < 4; i++) {
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv)); /* nearest even, as nearbyintf */
    c = _mm256_min_epi32(_mm256_max_epi32(c, lo), hi);
    total = _mm256_add_epi32(total, c);
    _mm256_storeu_si256((__m256i *)(codes + 8 * i), c);
  }
  for (int i = 0; i < BLOCK; i++) q[i] = (int8_t)codes[i];
  int32_t lanes[8];
  _mm256_storeu_si256((__m256i *)lanes, total);
  *sum = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
  *scale = most / 127.0f;
}
#endif

/* x's rows as int8 codes, a scale per block of 32 and the codes' sum per block: each row alone. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs, int32_t *xsum, int vector) {
  int64_t blocks = k / BLOCK;
  for (int64_t r = 0; r < m; r++)
    for (int64_t b = 0; b < blocks; b++) {
      const float *v = x + r * k + b * BLOCK;
      int8_t *q = xq + r * k + b * BLOCK;
#ifdef ROWS_X86
      if (vector) {
        quantize_block_avx2(v, q, xs + r * blocks + b, xsum + r * blocks + b);
        continue;
      }
#endif
      quantize_block_c(v, q, xs + r * blocks + b, xsum + r * blocks + b);
    }
}

/* The output columns of tile t: 16, or fewer in the last tile where N is not a multiple of 16. */
static int64_t columns(const Call *c, size_t t) {
  int64_t left = c->n - (int64_t)t * TILE;
  return left < TILE ? left : TILE;
}

/* Plain C: the reference every instruction set matches bit for bit (fmaf, as the vector kernels' FMA). */
static void tile_c(const void *data, size_t t) {
  const Call *c = (const Call *)data;
  int64_t blocks = c->k / BLOCK;
  for (int64_t r = 0; r < c->m; r++) {
    float acc[TILE] = {0};
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t *wt = c->w + ((int64_t)t * blocks + b) * TILE_BYTES;
      const int8_t *xq = c->xq + r * c->k + b * BLOCK;
      for (int col = 0; col < TILE; col++) {
        int32_t dot = 0;
        for (int p = 0; p < 4; p++)
          for (int j = 0; j < 4; j++) {
            uint8_t byte = wt[p * 64 + 4 * col + j];
            dot += (int32_t)(byte & 15) * xq[8 * p + j] + (int32_t)(byte >> 4) * xq[8 * p + 4 + j];
          }
        dot -= (int32_t)c->zeros[((int64_t)t * blocks + b) * TILE + col] * c->xsum[r * blocks + b];
        float scale = c->scales[((int64_t)t * blocks + b) * TILE + col] * c->xs[r * blocks + b];
        acc[col] = fmaf((float)dot, scale, acc[col]);
      }
    }
    memcpy(c->y + r * c->n + (int64_t)t * TILE, acc, sizeof(float) * columns(c, t));
  }
}

#ifdef ROWS_X86
/* `count` rows (1 or 4, a constant once inlined) of one block against the tile's unpacked weights: each row's
   products in two int32 sums (independent chains, so rows and sums overlap in the pipeline; integers, so the bits
   are those of one chain), then scaled and added to the row's outputs. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void vnni_rows(
    const Call *c, const __m512i *w, __m512i zv, __m512 sv, int64_t r, int64_t b, float *acc, int count) {
  int64_t blocks = c->k / BLOCK;
  __m512i even[4], odd[4];
#pragma GCC unroll 4
  for (int j = 0; j < count; j++) {
    even[j] = _mm512_mullo_epi32(zv, _mm512_set1_epi32(-c->xsum[(r + j) * blocks + b]));
    odd[j] = _mm512_setzero_si512();
  }
  for (int g = 0; g < 8; g += 2)
  #pragma GCC unroll 4
  for (int j = 0; j < count; j++) {
      const int8_t *xq = c->xq + (r + j) * c->k + b * BLOCK + 4 * g; /* 4 codes at a time, broadcast from memory */
      int32_t first, second;
      memcpy(&first, xq, 4);
      memcpy(&second, xq + 4, 4);
      even[j] = _mm512_dpbusd_epi32(even[j], w[g], _mm512_set1_epi32(first));
      odd[j] = _mm512_dpbusd_epi32(odd[j], w[g + 1], _mm512_set1_epi32(second));
    }
#pragma GCC unroll 4
  for (int j = 0; j < count; j++) {
    __m512i dot = _mm512_add_epi32(even[j], odd[j]);
    __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(c->xs[(r + j) * blocks + b]));
    __m512 a = _mm512_load_ps(acc + j * TILE);
    _mm512_store_ps(acc + j * TILE, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, a));
  }
}

/* AVX-512 VNNI: 16 columns in the 16 lanes; the tile's 8 unpacked vectors serve every row. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_vnni(const void *data, size_t t) {
  const Call *c = (const Call *)data;
  int64_t blocks = c->k / BLOCK;
  const __m512i low = _mm512_set1_epi8(15);
  float acc[ROW_CHUNK * TILE] __attribute__((aligned(64)));
  for (int64_t r0 = 0; r0 < c->m; r0 += ROW_CHUNK) {
    int64_t rows = c->m - r0 < ROW_CHUNK ? c->m - r0 : ROW_CHUNK;
    memset(acc, 0, sizeof(float) * rows * TILE);
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t *wt = c->w + ((int64_t)t * blocks + b) * TILE_BYTES;
      __m512i w[8];
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        __m512i v = _mm512_loadu_si512((const void *)(wt + 64 * p));
        w[2 * p] = _mm512_and_si512(v, low);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      int64_t at = ((int64_t)t * blocks + b) * TILE;
      __m512i zv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c->zeros + at)));
      __m512 sv = _mm512_loadu_ps(c->scales + at);
      int64_t i = 0;
      for (; i + 4 <= rows; i += 4) vnni_rows(c, w, zv, sv, r0 + i, b, acc + i * TILE, 4);
      for (; i < rows; i++) vnni_rows(c, w, zv, sv, r0 + i, b, acc + i * TILE, 1);
    }
    for (int64_t i = 0; i < rows; i++)
      memcpy(c->y + (r0 + i) * c->n + (int64_t)t * TILE, acc + i * TILE, sizeof(float) * columns(c, t));
  }
}

/* AVX2: the same tile as two halves of 8 columns; u8 x s8 pairs summed in int16 (15 * 127 * 2 cannot saturate). */
__attribute__((target("avx2,fma"))) static void tile_avx2(const void *data, size_t t) {
  const Call *c = (const Call *)data;
  int64_t blocks = c->k / BLOCK;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  float acc[ROW_CHUNK * TILE] __attribute__((aligned(32)));
  for (int64_t r0 = 0; r0 < c->m; r0 += ROW_CHUNK) {
    int64_t rows = c->m - r0 < ROW_CHUNK ? c->m - r0 : ROW_CHUNK;
    memset(acc, 0, sizeof(float) * rows * TILE);
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t *wt = c->w + ((int64_t)t * blocks + b) * TILE_BYTES;
      __m256i w[2][8];
      for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++) {
          __m256i v = _mm256_loadu_si256((const __m256i *)(wt + 64 * p + 32 * h));
          w[h][2 * p] = _mm256_and_si256(v, low);
          w[h][2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      int64_t at = ((int64_t)t * blocks + b) * TILE;
      __m256i zv[2];
      __m256 sv[2];
      for (int h = 0; h < 2; h++) {
        zv[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c->zeros + at + 8 * h)));
        sv[h] = _mm256_loadu_ps(c->scales + at + 8 * h);
      }
      for (int64_t i = 0; i < rows; i++) {
        int64_t r = r0 + i;
        const int8_t *xq = c->xq + r * c->k + b * BLOCK;
        __m256i neg = _mm256_set1_epi32(-c->xsum[r * blocks + b]);
        __m256 xs = _mm256_set1_ps(c->xs[r * blocks + b]);
        for (int h = 0; h < 2; h++) {
          /* the 8 groups summed in int16 lanes first: 16 products of at most 15 x 127 a lane, 30480 < 32767 */
          __m256i pairs = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int g = 0; g < 8; g++) {
            int32_t four;
            memcpy(&four, xq + 4 * g, 4);
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[h][g], _mm256_set1_epi32(four)));
          }
          __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(zv[h], neg), _mm256_madd_epi16(pairs, ones));
          __m256 scale = _mm256_mul_ps(sv[h], xs);
          __m256 a = _mm256_load_ps(acc + i * TILE + 8 * h);
          _mm256_store_ps(acc + i * TILE + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, a));
        }
      }
    }
    for (int64_t i = 0; i < rows; i++)
      memcpy(c->y + (r0 + i) * c->n + (int64_t)t * TILE, acc + i * TILE, sizeof(float) * columns(c, t));
  }
}
#endif

/* The widest kernel this CPU runs; SPECEXPORT_ROWS_ISA=c|avx2|vnni forces one (the tests compare them). */
static void (*pick_tile(void))(const void *, size_t) {
  const char *forced = getenv("SPECEXPORT_ROWS_ISA");
#ifdef ROWS_X86
  __builtin_cpu_init();
  int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (forced && strcmp(forced, "c") == 0) return tile_c;
  if (forced && strcmp(forced, "avx2") == 0 && avx2) return tile_avx2;
  if (vnni) return tile_vnni;
  if (avx2) return tile_avx2;
#else
  (void)forced;
#endif
  return tile_c;
}

static void run_tile(void *data, size_t t) { ((Call *)data)->tile(data, t); }

/* Whether a weight input holds exactly `want` elements: a graph whose weights do not match K and N is refused
   before any of them is read (a malformed bundle is an error, never a read past its tensors). */
static OrtStatus *check_size(const OrtValue *value, int64_t want, const char *message) {
  int64_t count = 0;
  CHECK(op_count(value, &count));
  return count == want ? NULL : op_error(message);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *context) {
  const Kernel *kn = (const Kernel *)kernel;
  const OrtValue *x, *w, *scales, *zeros;
  CHECK(api->KernelContext_GetInput(context, 0, &x));
  CHECK(api->KernelContext_GetInput(context, 1, &w));
  CHECK(api->KernelContext_GetInput(context, 2, &scales));
  CHECK(api->KernelContext_GetInput(context, 3, &zeros));
  size_t rank = 0;
  int64_t dims[8];
  CHECK(op_shape(x, dims, 8, &rank));
  if (rank < 1 || dims[rank - 1] != kn->k) return op_error("MatMulRows4: x's last dimension is not K");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < rank; i++) m *= dims[i];
  dims[rank - 1] = kn->n;
  int64_t tiles = (kn->n + TILE - 1) / TILE, cells = tiles * (kn->k / BLOCK);
  CHECK(check_size(w, cells * TILE_BYTES, "MatMulRows4: the packed weights do not match K and N"));
  CHECK(check_size(scales, cells * TILE, "MatMulRows4: the scales do not match K and N"));
  CHECK(check_size(zeros, cells * TILE, "MatMulRows4: the zero points do not match K and N"));
  OrtValue *out;
  CHECK(api->KernelContext_GetOutput(context, 0, dims, rank, &out));
  Call call = {0};
  call.m = m, call.k = kn->k, call.n = kn->n, call.tile = pick_tile();
  CHECK(api->GetTensorMutableData((OrtValue *)w, (void **)&call.w));
  CHECK(api->GetTensorMutableData((OrtValue *)scales, (void **)&call.scales));
  CHECK(api->GetTensorMutableData((OrtValue *)zeros, (void **)&call.zeros));
  CHECK(api->GetTensorMutableData(out, (void **)&call.y));
  if (m == 0) return NULL;
  const float *xf;
  CHECK(api->GetTensorMutableData((OrtValue *)x, (void **)&xf));
  int64_t blocks = kn->k / BLOCK;
  void *scratch = malloc((size_t)(m * kn->k) + (size_t)(m * blocks) * (sizeof(float) + sizeof(int32_t)));
  if (!scratch) return op_failed("MatMulRows4: out of memory");
  call.xs = (const float *)scratch;
  call.xsum = (const int32_t *)((float *)scratch + m * blocks);
  call.xq = (const int8_t *)((int32_t *)call.xsum + m * blocks);
  quantize_rows(xf, m, kn->k, (int8_t *)call.xq, (float *)call.xs, (int32_t *)call.xsum, call.tile != tile_c);
  OrtStatus *status = api->KernelContext_ParallelFor(context, run_tile, (size_t)tiles, 0, &call);
  free(scratch);
  return status;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info,
                                      void **kernel) {
  (void)op, (void)a;
  Kernel kn;
  CHECK(api->KernelInfoGetAttribute_int64(info, "K", &kn.k));
  CHECK(api->KernelInfoGetAttribute_int64(info, "N", &kn.n));
  if (kn.k <= 0 || kn.n <= 0 || kn.k % BLOCK) return op_error("MatMulRows4: K must be a multiple of 32 and N positive");
  Kernel *made = (Kernel *)malloc(sizeof kn);
  if (!made) return op_failed("MatMulRows4: out of memory");
  *made = kn;
  *kernel = made;
  return NULL;
}

static void ORT_API_CALL destroy(void *kernel) { free(kernel); }
static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "MatMulRows4"; }
static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  static const ONNXTensorElementDataType types[4] = {
      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8};
  return i < 4 ? types[i] : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static size_t ORT_API_CALL input_count(const OrtCustomOp *op) { (void)op; return 4; }
static ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp *op, size_t i) {
  (void)op, (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL output_count(const OrtCustomOp *op) { (void)op; return 1; }

void rows4_op(OrtCustomOp *op) {
  op_common(op);
  op->CreateKernelV2 = create, op->KernelComputeV2 = compute, op->KernelDestroy = destroy, op->GetName = name;
  op->GetInputType = input_type, op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type, op->GetOutputTypeCount = output_count;
}
