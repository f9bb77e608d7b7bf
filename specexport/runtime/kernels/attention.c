/* specexport.kernels::AttentionRows: attention of a batched step's real rows only, each row alone.

Why: ONNX Runtime's GroupQueryAttention takes the batch padded to its widest sequence (every sequence's tree, or a
prompt's chunk beside one-token decode rows, costs the widest one's rows) and needs the same number of new rows in
every sequence. This kernel takes the step's real rows packed ([R, ...], as the graph's ragged rows compute them),
each with its own sequence, position and tree mask, and writes their keys and values into the cache in place.

Exact per row: a row's output reads its own query, the cache rows it sees, and nothing else; its sums run over the
visible cache rows in ascending order (a dot product's elements in 8 fixed lanes), by fused multiply-adds, whatever
the other rows, where its tree put its ancestors, the number of threads or the instruction set (AVX2 and plain C
give the same bits). A cache row the row does not see is skipped, as an additive bias of -1e9 would make it.

Inputs: query float [..., H * D] (R rows; rotated), key and value float [..., G * D] (R rows; key rotated); rows
int64 [R] (b * T + t: the row's sequence b and its place t among the step's T padded rows); tree_mask bool
[B, T, K] (row t of sequence b sees mask column j, cache row past_len[b] + T - K + j, where tree_mask[b, t, j]);
past_len int32 [B]; past_key, past_value float [B, G, S, D]. A row sees every cache row before the mask's columns.
Outputs: y float (query's shape), present_key, present_value (the caches with the rows' keys and values at
past_len[b] + t; bound to the past buffers, they are written in place, else copied first).
Attributes: num_heads H, kv_num_heads G (H a multiple of G: the query heads sharing a key head read each cache row
once), scale (0: 1 / sqrt(D)), softcap (0: none; else softcap * tanh(s / softcap)), causal (1: ignore the mask's
values, row t sees the cache up to past_len[b] + t: plain decoding's chains).

Example: exporter/graph.py writes one node per layer where `build --attention-rows` asks for it. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ROWS_X86 1
#endif

#define LANES 8
#define CHUNK 64 /* the outputs of probs x V one pass keeps in registers: 8 vectors of 8 */
#define BLOCK_ROWS 4 /* rows of one sequence a work item takes together */
#define TILE_FLOATS 4096 /* the cache rows a tile holds: 16 KiB of keys (64 rows of 64) */

typedef struct {
  int64_t heads, kv_heads, causal;
  float scale, softcap;
} Kernel;

/* The loops of a row's head, in plain C or in vectors: the same bits either way (module docstring). */
typedef struct {
  /* out[j] = scale * (q . keys[cols[j]]) for the n visible cache rows */
  void (*scores)(const float *q, const float *keys, const int32_t *cols, int64_t n, int64_t d, float scale, float *out);
  /* p[j] = exp(p[j] - top) in place; returns their sum */
  float (*softmax)(float *p, int64_t n, float top);
  /* out += sum over j of p[j] * values[cols[j]], in ascending j (the caller zeroes out first) */
  void (*weigh)(const float *p, const float *values, const int32_t *cols, int64_t n, int64_t d, float *out);
} Loops;

typedef struct {
  const float *q, *k, *v;
  const int64_t *rows;
  int64_t *blocks; /* [2 x blocks]: each block's first packed row and its row count */
  const uint8_t *mask;
  const int32_t *past;
  float *cache_k, *cache_v, *y;
  int64_t r, b, t, kcols, s, d, heads, kv_heads, causal;
  float scale, softcap;
  Loops loops;
  OrtStatus *failed; /* set by a work item that ran out of memory */
} Call;

/* How 8 lanes are summed (the tree _mm256_hadd_ps makes): ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static float lanes_sum(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

/* exp(x) for x <= 0 (a softmax's shifted scores): n = round(x / ln 2), r = x - n ln 2 in two parts, a degree-7
   polynomial in r (Cephes' expf coefficients), times 2^n built in the exponent bits. Fused multiply-adds only, so
   the vector version below gives the same bits; within 2 ulp of expf. */
#define EXP_LOW -87.0f /* exp(-87) ~ 1.6e-38: the smallest normal float's neighbourhood; lower scores give ~0 */
static const float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static float exp_c(float x) {
  x = x < EXP_LOW ? EXP_LOW : x;
  float n = nearbyintf(x * 1.44269504088896341f);
  float r = fmaf(n, -0.693359375f, x);
  r = fmaf(n, 2.12194440e-4f, r);
  float y = EXP_C[0];
  for (int i = 1; i < 6; i++) y = fmaf(y, r, EXP_C[i]);
  y = fmaf(y, r * r, r) + 1.0f;
  uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

/* q . k: element i into lane i % 8 by fused multiply-adds in ascending i, then lanes_sum. */
static void scores_c(const float *q, const float *keys, const int32_t *cols, int64_t n, int64_t d, float scale,
                     float *out) {
  for (int64_t j = 0; j < n; j++) {
    const float *k = keys + (int64_t)cols[j] * d;
    float lane[LANES] = {0};
    for (int64_t i = 0; i < d; i++) lane[i % LANES] = fmaf(q[i], k[i], lane[i % LANES]);
    out[j] = lanes_sum(lane) * scale;
  }
}

/* exp of each shifted score; the sum: score j into lane j % 8 in ascending j, then lanes_sum. */
static float softmax_c(float *p, int64_t n, float top) {
  float lane[LANES] = {0};
  for (int64_t j = 0; j < n; j++) lane[j % LANES] += p[j] = exp_c(p[j] - top);
  return lanes_sum(lane);
}

/* out[i] += p[j] * values[cols[j]][i] by fused multiply-adds in ascending j. */
static void weigh_c(const float *p, const float *values, const int32_t *cols, int64_t n, int64_t d, float *out) {
  for (int64_t j = 0; j < n; j++) {
    const float *v = values + (int64_t)cols[j] * d;
    for (int64_t i = 0; i < d; i++) out[i] = fmaf(p[j], v[i], out[i]);
  }
}

#ifdef ROWS_X86
/* Eight cache rows at once, one accumulator each (independent chains), summed together by the hadd tree. */
__attribute__((target("avx2,fma"))) static void scores_avx2(const float *q, const float *keys, const int32_t *cols,
                                                            int64_t n, int64_t d, float scale, float *out) {
  int64_t j = 0;
  const __m256 sv = _mm256_set1_ps(scale);
  for (; j + 8 <= n; j += 8) {
    const float *k[8];
    __m256 a[8];
    for (int c = 0; c < 8; c++) k[c] = keys + (int64_t)cols[j + c] * d, a[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += LANES) {
      __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[c] + i), a[c]);
    }
    __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(sum, sv));
  }
  for (; j < n; j++) {
    const float *k = keys + (int64_t)cols[j] * d;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += LANES) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    float lane[LANES];
    _mm256_storeu_ps(lane, a);
    out[j] = lanes_sum(lane) * scale;
  }
}

__attribute__((target("avx2,fma"))) static float softmax_avx2(float *p, int64_t n, float top) {
  const __m256 low = _mm256_set1_ps(EXP_LOW), shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift), low);
    __m256 nv = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(nv, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(nv, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_C[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nv), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(p + j, y);
    total = _mm256_add_ps(total, y);
  }
  float lane[LANES];
  _mm256_storeu_ps(lane, total);
  for (; j < n; j++) lane[j % LANES] += p[j] = exp_c(p[j] - top);
  return lanes_sum(lane);
}

__attribute__((target("avx2,fma"))) static void weigh_avx2(const float *p, const float *values, const int32_t *cols,
                                                           int64_t n, int64_t d, float *out) {
  for (int64_t c0 = 0; c0 < d; c0 += CHUNK) {
    int64_t vectors = (d - c0 < CHUNK ? d - c0 : CHUNK) / LANES;
    __m256 acc[CHUNK / LANES];
    for (int k = 0; k < CHUNK / LANES; k++) acc[k] = k < vectors ? _mm256_loadu_ps(out + c0 + LANES * k)
                                                                 : _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
      const float *v = values + (int64_t)cols[j] * d + c0;
      __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
      for (int k = 0; k < CHUNK / LANES; k++)
        if (k < vectors) acc[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + LANES * k), acc[k]);
    }
    for (int64_t k = 0; k < vectors; k++) _mm256_storeu_ps(out + c0 + LANES * k, acc[k]);
  }
}
#endif

/* The widest loops this CPU runs; SPECEXPORT_ROWS_ISA=c forces plain C (the tests compare them). */
static Loops pick_loops(void) {
  Loops c = {scores_c, softmax_c, weigh_c};
#ifdef ROWS_X86
  const char *forced = getenv("SPECEXPORT_ROWS_ISA");
  __builtin_cpu_init();
  if (!(forced && strcmp(forced, "c") == 0) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    Loops avx2 = {scores_avx2, softmax_avx2, weigh_avx2};
    return avx2;
  }
#endif
  return c;
}

/* Work item i: block i / G of up to BLOCK_ROWS rows of one sequence, key head i % G, with the H / G query heads that
   share it: BLOCK_ROWS x H / G query vectors. Each row sees the cache rows before the step's own columns (`shared`,
   the same for the block's rows) and then its own among them (`tail`). The shared rows are taken in tiles that
   stay in the L1 cache while every query vector of the block reads them (one sequence's rows then read its keys
   and values once, not once a row). Every sum still runs over a row's visible cache rows in ascending order. */
static void run_item(void *data, size_t item) {
  Call *c = (Call *)data;
  int64_t block = (int64_t)item / c->kv_heads, g = (int64_t)item % c->kv_heads, group = c->heads / c->kv_heads;
  int64_t first = c->blocks[2 * block], m = c->blocks[2 * block + 1], d = c->d;
  int64_t b = c->rows[first] / c->t, past = c->past[b];
  int64_t start = past + c->t - c->kcols;              /* the mask's first column */
  int64_t shared = c->causal ? past : start, span = c->causal ? c->t : c->kcols; /* a row's own: at most span */
  int64_t widest = shared + span, nq = m * group;
  int64_t tile = TILE_FLOATS / d / LANES * LANES;
  tile = tile < LANES ? LANES : tile;
  void *scratch = malloc(sizeof(int32_t) * (size_t)(shared + m * span) + sizeof(float) * (size_t)(nq * widest) +
                         sizeof(int64_t) * (size_t)m);
  if (!scratch) {
    c->failed = op_failed("AttentionRows: out of memory");
    return;
  }
  int32_t *cols = (int32_t *)scratch, *tails = cols + shared; /* row i's own visible columns: tails + i * span */
  float *score = (float *)(tails + m * span);                 /* query vector v's scores: score + v * widest */
  int64_t *tail_n = (int64_t *)(score + nq * widest);
  for (int64_t j = 0; j < shared; j++) cols[j] = (int32_t)j;
  for (int64_t i = 0; i < m; i++) {
    int64_t t = c->rows[first + i] % c->t, n = 0;
    const uint8_t *mask = c->mask + (b * c->t + t) * c->kcols;
    int64_t end = c->causal ? past + t + 1 : past + c->t;
    for (int64_t col = shared; col < end; col++)
      if (c->causal || mask[col - start]) tails[i * span + n++] = (int32_t)col;
    tail_n[i] = n;
  }
  const float *keys = c->cache_k + (b * c->kv_heads + g) * c->s * d;
  const float *values = c->cache_v + (b * c->kv_heads + g) * c->s * d;
#define QUERY(v) (c->q + ((first + (v) / group) * c->heads + g * group + (v) % group) * d)
#define OUT(v) (c->y + ((first + (v) / group) * c->heads + g * group + (v) % group) * d)
  for (int64_t j0 = 0; j0 < shared; j0 += tile) {
    int64_t n = shared - j0 < tile ? shared - j0 : tile;
    for (int64_t v = 0; v < nq; v++) c->loops.scores(QUERY(v), keys, cols + j0, n, d, c->scale, score + v * widest + j0);
  }
  float *total = (float *)malloc(sizeof(float) * (size_t)nq);
  if (!total) {
    free(scratch);
    c->failed = op_failed("AttentionRows: out of memory");
    return;
  }
  for (int64_t v = 0; v < nq; v++) {
    int64_t i = v / group, n = shared + tail_n[i];
    float *sc = score + v * widest, top = -INFINITY;
    c->loops.scores(QUERY(v), keys, tails + i * span, tail_n[i], d, c->scale, sc + shared);
    for (int64_t j = 0; j < n; j++) {
      if (c->softcap > 0.0f) sc[j] = c->softcap * tanhf(sc[j] / c->softcap);
      top = sc[j] > top ? sc[j] : top;
    }
    total[v] = c->loops.softmax(sc, n, top);
    memset(OUT(v), 0, sizeof(float) * (size_t)d);
  }
  for (int64_t j0 = 0; j0 < shared; j0 += tile) {
    int64_t n = shared - j0 < tile ? shared - j0 : tile;
    for (int64_t v = 0; v < nq; v++) c->loops.weigh(score + v * widest + j0, values, cols + j0, n, d, OUT(v));
  }
  for (int64_t v = 0; v < nq; v++) {
    int64_t i = v / group;
    float *out = OUT(v);
    c->loops.weigh(score + v * widest + shared, values, tails + i * span, tail_n[i], d, out);
    float inv = total[v] > 0.0f ? 1.0f / total[v] : 0.0f;
    for (int64_t k = 0; k < d; k++) out[k] *= inv;
  }
#undef QUERY
#undef OUT
  free(total);
  free(scratch);
}

static OrtStatus *input(OrtKernelContext *context, size_t i, const OrtValue **value, int64_t *dims, size_t *rank) {
  CHECK(api->KernelContext_GetInput(context, i, value));
  return op_shape(*value, dims, 8, rank);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *context) {
  const Kernel *kn = (const Kernel *)kernel;
  const OrtValue *in[8];
  int64_t dims[8][8];
  size_t rank[8];
  for (size_t i = 0; i < 8; i++) CHECK(input(context, i, &in[i], dims[i], &rank[i]));
  if (rank[6] != 4 || rank[7] != 4 || memcmp(dims[6], dims[7], sizeof(int64_t) * 4))
    return op_error("AttentionRows: past_key and past_value must be [B, G, S, D] alike");
  Call c = {0};
  c.b = dims[6][0], c.kv_heads = dims[6][1], c.s = dims[6][2], c.d = dims[6][3], c.heads = kn->heads;
  c.causal = kn->causal, c.softcap = kn->softcap, c.loops = pick_loops();
  c.scale = kn->scale > 0.0f ? kn->scale : 1.0f / sqrtf((float)c.d);
  if (c.kv_heads != kn->kv_heads) return op_error("AttentionRows: the cache's heads are not kv_num_heads");
  if (c.d <= 0 || c.d % LANES) return op_error("AttentionRows: the head size must be a multiple of 8");
  int64_t counts[3];
  for (int i = 0; i < 3; i++) CHECK(op_count(in[i], &counts[i]));
  if (rank[3] != 1) return op_error("AttentionRows: rows must be [R]");
  c.r = dims[3][0];
  if (counts[0] != c.r * c.heads * c.d || counts[1] != c.r * c.kv_heads * c.d || counts[2] != counts[1] ||
      rank[0] < 1 || dims[0][rank[0] - 1] != c.heads * c.d)
    return op_error("AttentionRows: query, key and value must hold R rows of H * D, G * D and G * D");
  if (rank[4] != 3 || dims[4][0] != c.b || rank[5] != 1 || dims[5][0] != c.b)
    return op_error("AttentionRows: tree_mask must be [B, T, K] and past_len [B]");
  c.t = dims[4][1], c.kcols = dims[4][2];
  const float *past_k, *past_v;
  CHECK(api->GetTensorMutableData((OrtValue *)in[0], (void **)&c.q));
  CHECK(api->GetTensorMutableData((OrtValue *)in[1], (void **)&c.k));
  CHECK(api->GetTensorMutableData((OrtValue *)in[2], (void **)&c.v));
  CHECK(api->GetTensorMutableData((OrtValue *)in[3], (void **)&c.rows));
  CHECK(api->GetTensorMutableData((OrtValue *)in[4], (void **)&c.mask));
  CHECK(api->GetTensorMutableData((OrtValue *)in[5], (void **)&c.past));
  CHECK(api->GetTensorMutableData((OrtValue *)in[6], (void **)&past_k));
  CHECK(api->GetTensorMutableData((OrtValue *)in[7], (void **)&past_v));
  for (int64_t b = 0; b < c.b; b++)
    if (c.past[b] < 0 || c.past[b] + c.t > c.s || c.past[b] + c.t < c.kcols)
      return op_error("AttentionRows: a sequence's past_len leaves its step outside the cache");
  for (int64_t r = 0; r < c.r; r++)
    if (c.rows[r] < 0 || c.rows[r] >= c.b * c.t) return op_error("AttentionRows: a row is outside the batch");
  OrtValue *y, *present_k, *present_v;
  CHECK(api->KernelContext_GetOutput(context, 0, dims[0], rank[0], &y));
  CHECK(api->KernelContext_GetOutput(context, 1, dims[6], 4, &present_k));
  CHECK(api->KernelContext_GetOutput(context, 2, dims[7], 4, &present_v));
  CHECK(api->GetTensorMutableData(y, (void **)&c.y));
  CHECK(api->GetTensorMutableData(present_k, (void **)&c.cache_k));
  CHECK(api->GetTensorMutableData(present_v, (void **)&c.cache_v));
  size_t bytes = sizeof(float) * (size_t)(c.b * c.kv_heads * c.s * c.d);
  if (c.cache_k != past_k) memcpy(c.cache_k, past_k, bytes); /* not bound in place: the present starts as the past */
  if (c.cache_v != past_v) memcpy(c.cache_v, past_v, bytes);
  for (int64_t r = 0; r < c.r; r++) { /* every row's key and value in first: the rows of a tree read each other's */
    int64_t b = c.rows[r] / c.t, at = c.past[b] + c.rows[r] % c.t;
    for (int64_t g = 0; g < c.kv_heads; g++) {
      size_t to = (size_t)(((b * c.kv_heads + g) * c.s + at) * c.d), from = (size_t)((r * c.kv_heads + g) * c.d);
      memcpy(c.cache_k + to, c.k + from, sizeof(float) * (size_t)c.d);
      memcpy(c.cache_v + to, c.v + from, sizeof(float) * (size_t)c.d);
    }
  }
  if (c.r == 0) return NULL;
  c.blocks = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)c.r);
  if (!c.blocks) return op_failed("AttentionRows: out of memory");
  int64_t blocks = 0;
  for (int64_t r = 0; r < c.r; r++) { /* a block: consecutive rows of one sequence, at most BLOCK_ROWS */
    int64_t *last = c.blocks + 2 * (blocks - 1);
    if (blocks && c.rows[last[0]] / c.t == c.rows[r] / c.t && last[1] < BLOCK_ROWS)
      last[1]++;
    else
      c.blocks[2 * blocks] = r, c.blocks[2 * blocks + 1] = 1, blocks++;
  }
  OrtStatus *status = api->KernelContext_ParallelFor(context, run_item, (size_t)(blocks * c.kv_heads), 0, &c);
  free(c.blocks);
  return status ? status : c.failed;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info,
                                      void **kernel) {
  (void)op, (void)a;
  Kernel kn = {0};
  CHECK(api->KernelInfoGetAttribute_int64(info, "num_heads", &kn.heads));
  CHECK(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &kn.kv_heads));
  CHECK(api->KernelInfoGetAttribute_float(info, "scale", &kn.scale));
  CHECK(api->KernelInfoGetAttribute_float(info, "softcap", &kn.softcap));
  CHECK(api->KernelInfoGetAttribute_int64(info, "causal", &kn.causal));
  if (kn.heads <= 0 || kn.kv_heads <= 0 || kn.heads % kn.kv_heads)
    return op_error("AttentionRows: num_heads must be a positive multiple of kv_num_heads");
  Kernel *made = (Kernel *)malloc(sizeof kn);
  if (!made) return op_failed("AttentionRows: out of memory");
  *made = kn;
  *kernel = made;
  return NULL;
}

static void ORT_API_CALL destroy(void *kernel) { free(kernel); }
static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "AttentionRows"; }
static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  static const ONNXTensorElementDataType types[8] = {
      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  return i < 8 ? types[i] : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static size_t ORT_API_CALL input_count(const OrtCustomOp *op) { (void)op; return 8; }
static ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp *op, size_t i) {
  (void)op, (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL output_count(const OrtCustomOp *op) { (void)op; return 3; }

void attention_rows_op(OrtCustomOp *op) {
  op_common(op);
  op->CreateKernelV2 = create, op->KernelComputeV2 = compute, op->KernelDestroy = destroy, op->GetName = name;
  op->GetInputType = input_type, op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type, op->GetOutputTypeCount = output_count;
}
