/* What every kernel of specexport's custom-op library shares: the API table, errors, the OrtCustomOp callbacks
   that do not depend on the op, and each op's definition function (ops.c registers them in one domain).

Example: a kernel file defines `void my_op(OrtCustomOp *op)`, fills the op's own callbacks after `op_common(op)`,
and ops.c adds it to the domain. */

#ifndef SPECEXPORT_OPS_H
#define SPECEXPORT_OPS_H

#include <stdint.h>

#include "onnxruntime_c_api.h"

extern const OrtApi *api; /* set once by RegisterCustomOps */

#define CHECK(expr)                      \
  do {                                   \
    OrtStatus *status_ = (expr);         \
    if (status_) return status_;         \
  } while (0)

OrtStatus *op_error(const char *message);
OrtStatus *op_failed(const char *message); /* a failure that is no bad input (out of memory) */
/* The element count of a tensor, or the error status. */
OrtStatus *op_count(const OrtValue *value, int64_t *count);
/* The dimensions of a tensor (at most `most`): their number in *rank. */
OrtStatus *op_shape(const OrtValue *value, int64_t *dims, size_t most, size_t *rank);
/* The callbacks every op shares: the CPU provider, required inputs and outputs, version 1 on, nothing aliased. */
void op_common(OrtCustomOp *op);

void rows4_op(OrtCustomOp *op);          /* rows4.c: MatMulRows4 */
void attention_rows_op(OrtCustomOp *op); /* attention.c: AttentionRows */

#endif
