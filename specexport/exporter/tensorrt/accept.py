"""Tree acceptance as one Triton kernel: `runtime.verify`'s rules on the GPU, for the TensorRT plugin
(exporter/tensorrt/plugin.py) and for any CUDA host that has the target's logits on the device.

Needs triton (`pip install 'specexport[triton]'`); nothing else imports this module at its top, so an install
without triton never loads it. Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported) on CPU tensors, which is how the tests check it against the pure rules.

One program per batch row walks the tree from the root, as `verify.accept_greedy` / `verify.accept_tree` do:

    accept_tokens  [B, N] int32    the step's tokens; the tree is the last T (N >= T: a graph's input_ids, whose
                                   logits are those of its last T rows), root first
    accept_parents [B, T] int32    parents[b, 0] = -1, 0 <= parents[b, i] < i; a row with parent -1 (besides
                                   row 0) is no node: how a batch pads trees of different sizes
    logits         [B, T, V]       the target's logits over the tree rows (fp32, fp16 or bf16)
    sample_q       [B, Q, V] fp32  Q = T: the processed draft distribution each row's children were drawn from
                                   (sampled drafts); Q = 0: deterministic candidates ("topk")
    sample_u       [B, T, S] fp32  the uniforms of verify.uniforms_shape: u[r, j] tests the j-th child of r,
                                   u[r, S - 1] draws the final token at r (zeros when greedy)
    sample_params  [B, 4] fp32     temperature (0 = greedy), top_k (0 = off), top_p (1 = off), and 1 when the
                                   sampled drafts were drawn without replacement

the inputs of the in-graph acceptance (exporter/fused.py) with a batch axis, and writes fixed-shape outputs:

    accept_rows    [B, T] int32    the accepted rows, root first, then -1
    accept_len     [B] int32       how many rows were accepted (the accept length: drafts + the bonus token)
    bonus_token    [B] int32       the token the target adds after the last accepted row

Greedy (temperature 0) descends into the first child whose token is the argmax at its parent. Otherwise the
target's distribution is `sampling.probabilities` (temperature, top-k keeping ties, softmax, top-p breaking ties
by lower id) and the rule is `accept_tree`'s for the mode. Without a sort or a scratch buffer: top-k and top-p
thresholds are found by bisection over the float's bits (one pass over the vocabulary per bit, only at the rows
the walk visits), and the residual after k rejections at a row is recomputed per vocabulary block from the k
recorded (token, normaliser) pairs. Passes over the vocabulary per visited row: one when greedy; sampling, two,
+32 with top-k, +34 with top-p, +1 per rejected child and +2 for a final draw (each replaying the rejections so
far). Unmeasured on a GPU: one program per batch row leaves most of a large GPU idle. Arithmetic is float32 (the rules use float64), so a decision that falls
within rounding of its threshold may go the other way (the tests meet none).
Medusa's typical acceptance is lossy and stays on the host (`verify.accept_typical`).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

INPUTS = ("accept_tokens", "accept_parents", "logits", "sample_q", "sample_u", "sample_params")  # the kernel's order
SIZES = ("T", "V", "S", "Q_ROWS", "N")  # int32 scalars after the inputs: rows, vocabulary, uniform slots, draft
# rows (0 or T), tokens per batch row
OUTPUTS = ("accept_rows", "accept_len", "bonus_token")
LOGITS_DTYPES = ("fp32", "fp16", "bf16")
MAX_ROWS = 64  # tree rows one program handles (BLOCK_T)
NUM_WARPS = 4
INT32_MIN = tl.constexpr(-(2**31))
ONE_BITS = tl.constexpr(0x3F800000)  # the bits of 1.0f: every probability's bits lie in [0, ONE_BITS]


def block_sizes(rows: int, vocab: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_V) for a tree of `rows` rows over `vocab` tokens: both powers of two."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the tree acceptance kernel takes 1..{MAX_ROWS} rows, got {rows}")
    return max(16, triton.next_power_of_2(rows)), min(1024, max(16, triton.next_power_of_2(vocab)))


@triton.jit
def _at(vec, ar, i):
    """vec[i] of a small register vector (Triton has no dynamic indexing)."""
    return tl.sum(tl.where(ar == i, vec, 0), axis=0)


@triton.jit
def _key(x):
    """An int32 that orders like the float x (negatives flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _probs(row, offs, V, m, temperature, kth, s, tau, last_tie, mass):
    """Block `offs` of sampling.probabilities for one row: logits over the top-k (key >= kth), softmax with
    max m and sum s, top-p (bits > tau, or == tau up to id last_tie), renormalised by mass. With tau = -1
    and mass = 1 it is the softmax after top-k alone. One function, so every pass computes the same floats."""
    valid = offs < V
    x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.where(valid & (_key(x) >= kth), tl.exp((x - m) / temperature), 0.0) / s
    bits = z.to(tl.int32, bitcast=True)
    keep = (bits > tau) | ((bits == tau) & (offs <= last_tie))
    return tl.where(keep, z, 0.0) / mass


@triton.jit
def _replay(p, q, offs, steps, xs, zs, ys, ar, sampled, without):
    """The residual (and draft) distributions of a block after the row's first `steps` rejections
    (verify._reject): topk zeroes the rejected token; sampled takes max(0, p - q); without replacement also
    zeroes it in q. A normaliser <= 0 leaves the distribution as it was, as the rule falls back."""
    for k in range(0, steps):
        x, z, y = _at(xs, ar, k), _at(zs, ar, k), _at(ys, ar, k)
        residual = tl.where(sampled, tl.maximum(p - q, 0.0), tl.where(offs == x, 0.0, p))
        p = tl.where(z > 0, residual / tl.where(z > 0, z, 1.0), p)
        left = tl.where(offs == x, 0.0, q)
        q = tl.where(sampled & without, left / tl.where(y > 0, y, 1.0), q)
    return p, q


@triton.jit
def _argmax(row, V, BLOCK_V: tl.constexpr):
    """The first index of the row's largest logit, and that logit."""
    best_v = tl.load(row).to(tl.float32)
    best_i = tl.program_id(0) * 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        v = tl.max(x, axis=0)
        i = tl.min(tl.where(x == v, offs, V), axis=0)
        better = v > best_v
        best_i = tl.where(better, i, best_i)
        best_v = tl.where(better, v, best_v)
    return best_i, best_v


@triton.jit
def _kth_key(row, V, k, BLOCK_V: tl.constexpr):
    """The key of the k-th largest logit (counting ties): the largest key with >= k logits at or above it."""
    lo = (k * 0).to(tl.int64) + INT32_MIN
    hi = lo * 0 + (2**31 - 1)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        count = k * 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            count += tl.sum(((_key(x) >= mid) & (offs < V)).to(tl.int32), axis=0)
        lo = tl.where(count >= k, mid, lo)
        hi = tl.where(count >= k, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _nucleus(row, V, m, temperature, kth, s, top_p, BLOCK_V: tl.constexpr):
    """Top-p as (tau, last_tie, mass): keep the probabilities above tau, the ties at tau up to id last_tie
    (lower ids first, as a stable sort), and renormalise by their mass."""
    lo = kth * 0
    hi = lo + ONE_BITS
    for _ in range(31):  # the smallest bits b with mass(> b) < top_p: the last kept probability's bits
        mid = (lo + hi) >> 1
        above = top_p * 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            z = _probs(row, offs, V, m, temperature, kth, s, -1, V, 1.0)
            above += tl.sum(tl.where(z.to(tl.int32, bitcast=True) > mid, z, 0.0), axis=0)
        hi = tl.where(above < top_p, mid, hi)
        lo = tl.where(above < top_p, lo, mid + 1)
    tau = hi
    above = top_p * 0.0
    ties = lo * 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = _probs(row, offs, V, m, temperature, kth, s, -1, V, 1.0)
        bits = z.to(tl.int32, bitcast=True)
        above += tl.sum(tl.where(bits > tau, z, 0.0), axis=0)
        ties += tl.sum(((bits == tau) & (offs < V)).to(tl.int32), axis=0)
    # tie r (0-based, by id) is kept while the mass before it, above + r * tau, is < top_p
    value = tau.to(tl.float32, bitcast=True)
    wanted = tl.where(value > 0, tl.ceil((top_p - above) / tl.maximum(value, 1e-30)), 0.0)
    keep = tl.minimum(tl.maximum(wanted, 1.0), ties.to(tl.float32)).to(tl.int32)
    last_tie = lo * 0 - 1
    seen = lo * 0
    mass = top_p * 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = _probs(row, offs, V, m, temperature, kth, s, -1, V, 1.0)
        bits = z.to(tl.int32, bitcast=True)
        tie = (bits == tau) & (offs < V) & (bits > 0)
        rank = seen + tl.cumsum(tie.to(tl.int32), axis=0)
        last_tie = tl.maximum(last_tie, tl.max(tl.where(tie & (rank == keep), offs, -1), axis=0))
        seen += tl.sum(tie.to(tl.int32), axis=0)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mass += tl.sum(_probs(row, offs, V, m, temperature, kth, s, tau, last_tie, 1.0), axis=0)
    return tau, last_tie, mass


@triton.jit
def _sampled_step(row, qrow, urow, node, tok, par, ar, T, V, S, temperature, top_k, top_p, sampled, without,
                  BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """accept_tree at one row: returns (the accepted child, or -1, and the final token drawn when none was)."""
    _, m = _argmax(row, V, BLOCK_V)
    kth = node * 0 + INT32_MIN
    if (top_k > 0) & (top_k < V):
        kth = _kth_key(row, V, top_k, BLOCK_V)
    s = temperature * 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s += tl.sum(_probs(row, offs, V, m, temperature, kth, 1.0, -1, V, 1.0), axis=0)
    tau, last_tie, mass = node * 0 - 1, node * 0 + V, temperature * 0.0 + 1.0
    if top_p < 1.0:
        tau, last_tie, mass = _nucleus(row, V, m, temperature, kth, s, top_p, BLOCK_V)

    q_end = tl.where(sampled, V, 0)  # no draft rows in topk mode (as a bound: the interpreter lacks vector & bool)
    xs = tl.zeros([BLOCK_T], dtype=tl.int32)  # the rejections so far: token, p normaliser, q normaliser
    zs = tl.zeros([BLOCK_T], dtype=tl.float32)
    ys = tl.zeros([BLOCK_T], dtype=tl.float32)
    steps = node * 0
    rank = node * 0
    child = node * 0 - 1
    for c in range(node + 1, tl.minimum(T, BLOCK_T)):
        if (child < 0) & (_at(par, ar, c) == node):
            x = _at(tok, ar, c)
            offs = (x // BLOCK_V) * BLOCK_V + tl.arange(0, BLOCK_V)
            p = _probs(row, offs, V, m, temperature, kth, s, tau, last_tie, mass)
            q = tl.load(qrow + offs, mask=offs < q_end, other=0.0)
            p, q = _replay(p, q, offs, steps, xs, zs, ys, ar, sampled, without)
            px, qx = tl.sum(tl.where(offs == x, p, 0.0), axis=0), tl.sum(tl.where(offs == x, q, 0.0), axis=0)
            u = tl.load(urow + tl.minimum(rank, S - 1))
            live = (~sampled) | (qx > 0)  # q(x) = 0: the draft cannot have drawn x, no such event
            accepted = tl.where(sampled, u * qx < px, u < px)
            if live & accepted:
                child = c
            if live & (~accepted):  # the residual's normalisers after rejecting x
                z_sum, q_sum = temperature * 0.0, temperature * 0.0
                for start in range(0, V, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    p = _probs(row, offs, V, m, temperature, kth, s, tau, last_tie, mass)
                    q = tl.load(qrow + offs, mask=offs < q_end, other=0.0)
                    p, q = _replay(p, q, offs, steps, xs, zs, ys, ar, sampled, without)
                    residual = tl.where(sampled, tl.maximum(p - q, 0.0), tl.where(offs == x, 0.0, p))
                    z_sum += tl.sum(tl.where(offs < V, residual, 0.0), axis=0)
                    q_sum += tl.sum(tl.where((offs < V) & (offs != x), q, 0.0), axis=0)
                xs = tl.where(ar == steps, x, xs)
                zs = tl.where(ar == steps, z_sum, zs)
                ys = tl.where(ar == steps, q_sum, ys)
                steps += 1
            rank += 1

    # no child accepted: draw from the residual by inverse CDF (sampling.sample), never a token of no mass
    target = temperature * 0.0
    if child < 0:
        total = temperature * 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p = _probs(row, offs, V, m, temperature, kth, s, tau, last_tie, mass)
            q = tl.load(qrow + offs, mask=offs < q_end, other=0.0)
            p, q = _replay(p, q, offs, steps, xs, zs, ys, ar, sampled, without)
            total += tl.sum(tl.where(offs < V, p, 0.0), axis=0)
        target = tl.load(urow + S - 1) * total
    token, token_p, last, cdf = node * 0 + V, temperature * 0.0, node * 0 - 1, temperature * 0.0
    if child < 0:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p = _probs(row, offs, V, m, temperature, kth, s, tau, last_tie, mass)
            q = tl.load(qrow + offs, mask=offs < q_end, other=0.0)
            p, q = _replay(p, q, offs, steps, xs, zs, ys, ar, sampled, without)
            p = tl.where(offs < V, p, 0.0)
            running = cdf + tl.cumsum(p, axis=0)
            first = tl.min(tl.where((running > target) & (offs < V), offs, V), axis=0)
            take = (token == V) & (first < V)
            token_p = tl.where(take, tl.sum(tl.where(offs == first, p, 0.0), axis=0), token_p)
            token = tl.where(take, first, token)
            last = tl.maximum(last, tl.max(tl.where(p > 0, offs, -1), axis=0))
            cdf += tl.sum(p, axis=0)
    final = tl.where((token == V) | (token_p == 0), last, token)
    return child, final


@triton.jit
def tree_accept_kernel(tokens_ptr, parents_ptr, logits_ptr, q_ptr, u_ptr, params_ptr,
                       T, V, S, Q_ROWS, N,
                       rows_ptr, length_ptr, bonus_ptr,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inputs, then the int32 sizes (SIZES), then the outputs: the order TensorRT's AOT plugins pass a kernel's
    arguments in. Rows past BLOCK_T are no nodes (a prefill call's outputs, which nobody reads)."""
    b = tl.program_id(0).to(tl.int64)
    ar = tl.arange(0, BLOCK_T)
    tok = tl.load(tokens_ptr + b * N + (N - T) + ar, mask=ar < T, other=-1)
    par = tl.load(parents_ptr + b * T + ar, mask=(ar < T) & (ar > 0), other=-1)
    temperature = tl.load(params_ptr + b * 4)
    top_k = tl.load(params_ptr + b * 4 + 1).to(tl.int32)
    top_p = tl.load(params_ptr + b * 4 + 2)
    without = tl.load(params_ptr + b * 4 + 3) > 0.5
    greedy = temperature <= 0.0
    zero = tl.program_id(0) * 0  # an int32 tensor (a plain 0 would be a Python int in the interpreter)
    sampled = (zero + Q_ROWS > 0) & (~greedy)

    node = zero
    depth = zero
    path = tl.where(ar == 0, 0, -1)
    bonus = zero
    going = zero == 0
    while going:
        row = logits_ptr + (b * T + node) * V
        child = node * 0 - 1
        final = node * 0
        if greedy:
            best, _ = _argmax(row, V, BLOCK_V)
            match = (par == node) & (tok == best)
            first = tl.min(tl.where(match, ar, BLOCK_T), axis=0)
            child = tl.where(first < BLOCK_T, first, -1)
            final = best
        else:
            qrow = q_ptr + (b * Q_ROWS + node) * V
            urow = u_ptr + (b * T + node) * S
            child, final = _sampled_step(row, qrow, urow, node, tok, par, ar, T, V, S, temperature, top_k, top_p,
                                         sampled, without, BLOCK_T, BLOCK_V)
        if child >= 0:
            depth += 1
            path = tl.where(ar == depth, child, path)
            node = child
        else:
            bonus = final
            going = zero != 0
    tl.store(rows_ptr + b * T + ar, path, mask=ar < T)
    tl.store(length_ptr + b, depth + 1)
    tl.store(bonus_ptr + b, bonus)


def tree_accept(tokens, parents, logits, sample_q, sample_u, sample_params, block_v: int | None = None):
    """Run the kernel on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns the three outputs.

    Shapes as in the module docstring; the int inputs int32, the float ones float32 (logits also fp16/bf16).
    `block_v` (a power of two) overrides the vocabulary block, so a test can walk a small vocabulary in blocks.
    """
    import torch

    batch, rows, vocab = logits.shape
    if tokens.dim() != 2 or tokens.shape[0] != batch or tokens.shape[1] < rows:
        raise ValueError(f"tokens must have shape [{batch}, >= {rows}], got {list(tokens.shape)}")
    shapes = {"parents": (parents, (batch, rows)),
              "sample_u": (sample_u, (batch, rows, sample_u.shape[-1])),
              "sample_q": (sample_q, (batch, sample_q.shape[1], vocab)), "sample_params": (sample_params, (batch, 4))}
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if sample_q.shape[1] not in (0, rows):
        raise ValueError(f"sample_q must have 0 or {rows} rows, got {sample_q.shape[1]}")
    block_t, default_v = block_sizes(rows, vocab)
    block_v = block_v or default_v
    device = logits.device
    out_rows = torch.empty((batch, rows), dtype=torch.int32, device=device)
    out_len = torch.empty((batch,), dtype=torch.int32, device=device)
    out_bonus = torch.empty((batch,), dtype=torch.int32, device=device)
    inputs = (tokens.to(torch.int32).contiguous(), parents.to(torch.int32).contiguous(), logits.contiguous(),
              sample_q.float().contiguous(), sample_u.float().contiguous(), sample_params.float().contiguous())
    sizes = (rows, vocab, sample_u.shape[-1], sample_q.shape[1], tokens.shape[1])
    tree_accept_kernel[(batch,)](*inputs, *sizes, out_rows, out_len, out_bonus, BLOCK_T=block_t, BLOCK_V=block_v,
                                 num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out_rows, out_len, out_bonus


def compile_ptx(logits_dtype: str = "fp32", target=None, ptx_version: int | None = None) -> tuple[str, str, int]:
    """The kernel compiled ahead of time for every tree up to MAX_ROWS rows and any vocabulary: (kernel name, PTX,
    shared memory bytes). `target` a triton GPUTarget (default: this machine's GPU; the NVIDIA backend compiles to
    PTX without one); `ptx_version` the PTX ISA as an int (87 = 8.7; default: what Triton's own ptxas takes, which
    may be newer than the driver that will load it). The PTX takes exactly the arguments a TensorRT AOT plugin
    passes (inputs, sizes, outputs)."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be one of {LOGITS_DTYPES}, got {logits_dtype}")
    kinds = ["*i32", "*i32", f"*{logits_dtype}", "*fp32", "*fp32", "*fp32"] + ["i32"] * len(SIZES)
    kinds += ["*i32"] * len(OUTPUTS)
    names = tree_accept_kernel.arg_names
    signature = dict(zip(names, kinds + ["constexpr", "constexpr"]))
    source = triton.compiler.ASTSource(tree_accept_kernel, signature,
                                       constexprs={"BLOCK_T": MAX_ROWS, "BLOCK_V": block_sizes(1, 1 << 20)[1]})
    kernel = triton.compile(source, target=target, options={"num_warps": NUM_WARPS, "enable_fp_fusion": False,
                                                       "ptx_version": ptx_version})
    name = kernel.metadata.name
    return name, without_hidden_params(kernel.asm["ptx"], name, len(kinds)), kernel.metadata.shared


def without_hidden_params(ptx: str, name: str, count: int) -> str:
    """The PTX with its entry cut to its first `count` parameters. Triton (3.3 on) appends scratch-memory pointers
    that its own launcher fills; a TensorRT AOT plugin passes only the kernel's inputs, sizes and outputs, so the
    appended ones go, provided the kernel never reads them (the kernel allocates no scratch memory)."""
    head = re.search(rf"\.entry {re.escape(name)}\((.*?)\)", ptx, re.S)
    if head is None:
        raise ValueError(f"no entry {name} in the PTX")
    params = [p.strip() for p in head.group(1).split(",")]
    if len(params) < count:
        raise ValueError(f"the entry {name} has {len(params)} parameters, fewer than the {count} passed")
    for param in params[count:]:
        if ptx.count(param.split()[-1]) != 1:
            raise ValueError(f"the kernel reads its hidden parameter {param.split()[-1]}: it cannot run as a plugin")
    entry = f".entry {name}(\n\t" + ",\n\t".join(params[:count]) + "\n)"
    return ptx[:head.start()] + entry + ptx[head.end():]
