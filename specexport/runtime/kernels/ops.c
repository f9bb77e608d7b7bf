/* The library's entry point: RegisterCustomOps puts every kernel of this folder in the domain
   "specexport.kernels" (exporter/graph.py writes its nodes there). See ops.h. */

#include <stdlib.h>
#include <string.h>

#include "ops.h"

const OrtApi *api;

OrtStatus *op_error(const char *message) { return api->CreateStatus(ORT_INVALID_ARGUMENT, message); }

OrtStatus *op_failed(const char *message) { return api->CreateStatus(ORT_FAIL, message); }

OrtStatus *op_count(const OrtValue *value, int64_t *count) {
  OrtTensorTypeAndShapeInfo *info;
  CHECK(api->GetTensorTypeAndShape(value, &info));
  size_t n = 0;
  OrtStatus *status = api->GetTensorShapeElementCount(info, &n);
  api->ReleaseTensorTypeAndShapeInfo(info);
  *count = (int64_t)n;
  return status;
}

OrtStatus *op_shape(const OrtValue *value, int64_t *dims, size_t most, size_t *rank) {
  OrtTensorTypeAndShapeInfo *info;
  CHECK(api->GetTensorTypeAndShape(value, &info));
  OrtStatus *status = api->GetDimensionsCount(info, rank);
  if (!status && *rank > most) status = op_error("specexport kernels: a tensor has too many dimensions");
  if (!status) status = api->GetDimensions(info, dims, *rank);
  api->ReleaseTensorTypeAndShapeInfo(info);
  return status;
}

static const char *ORT_API_CALL provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp *op, size_t i) {
  (void)op, (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ORT_API_CALL memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static int ORT_API_CALL one(const OrtCustomOp *op) { (void)op; return 1; }
static int ORT_API_CALL none(const OrtCustomOp *op) { (void)op; return 0; }
static int ORT_API_CALL last(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t ORT_API_CALL no_map(int **inputs, int **outputs) { *inputs = NULL, *outputs = NULL; return 0; }
static void ORT_API_CALL free_map(int *inputs, int *outputs) { free(inputs), free(outputs); }

void op_common(OrtCustomOp *op) {
  memset(op, 0, sizeof *op);
  op->version = ORT_API_VERSION;
  op->GetExecutionProviderType = provider;
  op->GetInputCharacteristic = required, op->GetOutputCharacteristic = required, op->GetInputMemoryType = memory;
  op->GetVariadicInputMinArity = one, op->GetVariadicInputHomogeneity = none;
  op->GetVariadicOutputMinArity = one, op->GetVariadicOutputHomogeneity = none;
  op->GetStartVersion = one, op->GetEndVersion = last;
  op->GetMayInplace = no_map, op->ReleaseMayInplace = free_map, op->GetAliasMap = no_map, op->ReleaseAliasMap = free_map;
}

static OrtCustomOp ops[2];
static OrtCustomOpDomain *domain;

/* The entry point SessionOptions.register_custom_ops_library calls. */
OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  api = base->GetApi(ORT_API_VERSION);
  if (!api) return NULL; /* an onnxruntime older than these headers: the graph's ops stay unknown, and say so */
  if (!domain) {
    rows4_op(&ops[0]);
    attention_rows_op(&ops[1]);
    CHECK(api->CreateCustomOpDomain("specexport.kernels", &domain));
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) CHECK(api->CustomOpDomain_Add(domain, &ops[i]));
  }
  return api->AddCustomOpDomain(options, domain);
}
