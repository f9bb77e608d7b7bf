"""Numerics: the exported graph against the transformers model, on every shape class the runtime uses.

Cases (each a sequence of steps sharing one KV cache): a 32-token prefill then a T=1 decode; a
branching tree with no past; a branching tree after a prefill; a batch of two. Every row's logits
are compared. Quantized graphs are also scored by top-1 agreement with the fp32 transformers model,
teacher-forced over real prompts.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from specexport.exporter.eagle import DraftModule
from specexport.exporter.layerwise import module_weight
from specexport.prompts import AGREEMENT_NEW_TOKENS, AGREEMENT_PROMPTS
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.verify import accept_greedy

TREE = [-1, 0, 0, 1, 1, 2, 3, 5]  # two branches at the root, a deeper left branch


@dataclass
class Step:
    ids: np.ndarray  # [B, T]
    parents: list[int]  # tree of the T new tokens


def cases(vocab: int, seed: int = 0, chain_only: bool = False) -> dict[str, list[Step]]:
    """The shape classes; a chain-only graph (plain decoding) gets chains where the others get trees."""
    rng = np.random.default_rng(seed)
    shape = tree.chain(len(TREE)).tolist() if chain_only else TREE
    kind = "chain" if chain_only else "tree"

    def ids(b, t):
        return rng.integers(3, vocab, size=(b, t))

    return {
        "prefill_32+decode": [Step(ids(1, 32), tree.chain(32).tolist()), Step(ids(1, 1), [-1])],
        f"{kind}_no_past": [Step(ids(1, len(shape)), shape)],
        f"{kind}_after_past": [Step(ids(1, 20), tree.chain(20).tolist()), Step(ids(1, len(shape)), shape)],
        "batch_2": [Step(ids(2, 12), tree.chain(12).tolist()),
                    Step(ids(2, 4), tree.chain(4).tolist() if chain_only else [-1, 0, 0, 1])],
    }


def reference_steps(model, steps: list[Step]) -> list[np.ndarray]:
    """transformers logits for each step, fed the same tree bias and positions as the graph."""
    import torch
    from transformers import DynamicCache

    # every layer keeps every row (transformers' sliding layers would drop those out of the window; the bias hides them)
    cache, past, out = DynamicCache(), 0, []
    for step in steps:
        b, t = step.ids.shape
        bias = reference_bias(model, step.parents, past, b)
        positions = np.broadcast_to(past + tree.depths(step.parents), (b, t))
        with torch.no_grad():
            logits = model(
                input_ids=torch.from_numpy(step.ids),
                position_ids=torch.from_numpy(positions.copy()),  # broadcast_to views are read-only
                attention_mask=bias,
                cache=cache,
                use_cache=True,
            ).logits
        out.append(logits.float().numpy())
        past += t
    return out


def reference_bias(model, parents: list[int], past: int, batch: int):
    """The 4-D additive bias a transformers reference takes for a tree step after `past` rows: the tree's, and, for
    a model with sliding layers, the same with the positions a window leaves out hidden (a column's position is its
    index in the past, its node's depth in the tree), per layer type where the model takes a mask per type."""
    import torch

    from specexport.exporter.arch import layer_windows

    full = tree.attention_bias(parents, past, batch=batch)
    windows = set(layer_windows(model.config)) - {0}
    if not windows:
        return torch.from_numpy(full)
    (window,) = windows  # transformers has one sliding_window per config
    rows = past + tree.depths(parents)
    cols = np.concatenate([np.arange(past), rows])
    windowed = np.where(cols[None, :] <= rows[:, None] - window, tree.HIDDEN, full).astype(np.float32)
    if getattr(model.config, "layer_types", None) is None:  # one window over every layer (Mistral, Phi-3)
        return torch.from_numpy(windowed)
    return {"full_attention": torch.from_numpy(full), "sliding_attention": torch.from_numpy(windowed)}


def graph_steps(session, steps: list[Step]) -> list[np.ndarray]:
    b = steps[0].ids.shape[0]
    cache = session.new_cache(sum(s.ids.shape[1] for s in steps) + 8, batch=b)
    out = []
    for step in steps:
        t = step.ids.shape[1]
        past = cache.length
        positions = np.broadcast_to(past + tree.depths(step.parents), (b, t))
        rows = np.arange(b * t)
        logits = session.forward(cache, step.ids, positions, tree.ancestor_mask(step.parents), rows)["logits"]
        out.append(logits.reshape(b, t, -1))
        cache.advance(t)
    return out


def compare(model, session, seed: int = 0, chain_only: bool = False, max_context: int | None = None) -> dict[str, dict]:
    """Per case: max abs logit difference and top-1 agreement over all rows (`max_context`: the bundle's, for the
    LongRoPE factors it chose)."""
    return compare_with(reference_cases(model, seed, chain_only, max_context), session)


def reference_cases(model, seed: int = 0, chain_only: bool = False, max_context: int | None = None) -> dict:
    """Per case: (its steps, transformers' logits for each step)."""
    out = {}
    for name, steps in cases(model.config.vocab_size, seed, chain_only).items():
        with longrope_reference(model, max_context):
            out[name] = (steps, reference_steps(model, steps))
    return out


def compare_with(references: dict, session) -> dict[str, dict]:
    """compare() against references computed before (reference_cases)."""
    report = {}
    for name, (steps, ref) in references.items():
        got = graph_steps(session, steps)
        diff = max(float(np.abs(r - g).max()) for r, g in zip(ref, got))
        agree = np.mean(np.concatenate([(r.argmax(-1) == g.argmax(-1)).ravel() for r, g in zip(ref, got)]))
        report[name] = {"max_abs_diff": diff, "top1_agreement": float(agree)}
    return report


@contextmanager
def longrope_reference(model, max_context: int | None):
    """transformers with a bundle's LongRoPE factors for every sequence length (arch.longrope_policy): the long
    ones made its short ones too while inside, where the bundle took the long ones."""
    import torch

    from specexport.exporter.arch import longrope_policy
    from specexport.exporter.save import rope_inv_freq

    rotary = getattr(model.model, "rotary_emb", None)
    if max_context is None or longrope_policy(model.config, max_context) != "long":
        yield
        return
    saved = rotary.original_inv_freq
    rotary.original_inv_freq = torch.from_numpy(rope_inv_freq(rotary, model.config, "default", max_context)[0])
    try:
        yield
    finally:
        rotary.original_inv_freq = saved


def check_graph(model, tokenizer, folder, graph_info: dict, precision: str, agreement: bool,
                max_context: int | None = None) -> dict:
    """A bundle's step graph against its transformers model: logits on every shape class (`compare`); with
    `agreement`, top-1 agreement with fp32 on generated text (a quantized graph)."""
    model.config._attn_implementation = "eager"  # the literal reference: the bias is added to the scores
    references = reference_cases(model, chain_only=bool(graph_info.get("chain_only")), max_context=max_context)
    report = {}
    if agreement:
        if hasattr(model, "layerwise_weight"):  # a forward reads the whole checkpoint: no generation, the prompts
            sequences = [(prompt_ids(tokenizer, prompt), 1) for prompt in AGREEMENT_PROMPTS]
            report["agreement_text"] = "the prompts' own tokens (a layer-wise reference: no generated text)"
        else:
            sequences = reference_sequences(model, tokenizer, AGREEMENT_PROMPTS, AGREEMENT_NEW_TOKENS)
        top1 = reference_top1(model, sequences)
    # opened once the reference is done: a big model's session and its reference never peak together
    session = GraphSession(folder / graph_info["file"], graph_info)
    report["cases"] = compare_with(references, session)
    report["max_abs_diff"] = max(case["max_abs_diff"] for case in report["cases"].values())
    if agreement:
        report["agreement"] = agreement_on_prompts(top1, session, sequences, precision == "int8")
    return report


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's ids, chat-formatted where the tokenizer has a template."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def reference_sequences(model, tokenizer, prompts: list[str], new_tokens: int) -> list[tuple[list[int], int]]:
    """(ids, prompt length): chat-formatted prompts followed by the fp32 model's own greedy continuation."""
    import torch

    sequences = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        sequences.append((out[0].tolist(), len(ids)))
    return sequences


def reference_top1(model, sequences: list[tuple[list[int], int]]) -> list[np.ndarray]:
    """The fp32 model's top-1 token at every position of each sequence (one forward each)."""
    import torch

    refs = []
    for ids, _ in sequences:
        with torch.no_grad():
            refs.append(model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).numpy())
    return refs


def agreement_on_prompts(refs: list[np.ndarray], session, sequences: list[tuple[list[int], int]],
                         prefill_first_alone: bool, steps: tuple[int, ...] = (1, 8)) -> dict:
    """Teacher-forced top-1 agreement with the fp32 model's top-1 (`refs`, reference_top1) at the positions from
    each sequence's prompt length on.

    The prompt is prefilled the way the runtime does it; the continuation is then fed in steps of
    T tokens for each T in `steps`: 1 is plain decoding, 8 a verification-sized step.
    """
    result = {}
    for step in steps:
        hits = total = 0
        for (ids, n), ref in zip(sequences, refs):
            prompt = [ids[:1], ids[1:n]] if prefill_first_alone else [ids[:n]]
            pieces = [p for p in prompt if p] + [ids[j:j + step] for j in range(n, len(ids), step)]
            cache = session.new_cache(len(ids))
            got = []
            for piece in pieces:
                past, t = cache.length, len(piece)
                logits = session.forward(cache, np.array([piece]), past + np.arange(t)[None], tree.causal_mask(t),
                                         np.arange(t))["logits"]
                got.append(logits.argmax(-1))
                cache.advance(t)
            got = np.concatenate(got)
            hits += int((got[n - 1:] == ref[n - 1:]).sum())
            total += len(ids) - n + 1
        result[f"top1_agreement_t{step}"] = hits / max(total, 1)
    result["positions"] = total
    return result


def medusa_step(model, session, heads_session, heads, seed: int = 0, prefix: int = 20) -> dict:
    """The fused Medusa step against a PyTorch reference on a branching tree after a prefix.

    The tree's tokens are drawn so that a random part of it is what the reference would accept (each node,
    with probability 0.6, carries the reference's argmax at its parent). The reference: transformers logits
    and final hidden states over the same tree, greedy acceptance, then the heads in numpy at the last
    accepted row. Reports whether the accepted path and bonus token match, and the heads' candidates: the
    share that match, and the largest reference-logit gap between a mismatched candidate and the reference's
    one of the same rank (a near-tie when small). The stand-alone heads graph is scored the same way on the
    reference hidden row.
    """
    import torch
    from transformers import DynamicCache

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, size=prefix)
    tokens = rng.integers(3, vocab, size=len(TREE))
    lm_head = module_weight(model, "lm_head.").numpy()

    def reference(tokens):
        cache = DynamicCache()  # every layer keeps every row: the bias hides what a window leaves out (reference_steps)
        hidden = []
        for ids, parents, past in ((prompt, tree.chain(prefix).tolist(), 0), (tokens, TREE, prefix)):
            with torch.no_grad():
                out = model.model(input_ids=torch.from_numpy(np.array([ids])),
                                  position_ids=torch.from_numpy((past + tree.depths(parents))[None].copy()),
                                  attention_mask=reference_bias(model, parents, past, 1), cache=cache, use_cache=True)
            hidden.append(out.last_hidden_state[0].float().numpy())
        return hidden[1]

    for node in range(1, len(TREE)):  # a random part of the tree is what the reference accepts
        if rng.random() < 0.6:
            tokens[node] = int((reference(tokens)[TREE[node]] @ lm_head.T).argmax())
    hidden = reference(tokens)
    logits = hidden @ lm_head.T
    ref = accept_greedy(tokens.tolist(), TREE, logits.argmax(-1))
    ref_heads = heads.numpy_forward(hidden[ref.path[-1]][None], lm_head)[:, 0]  # [heads, vocab]

    cache = session.new_cache(prefix + len(TREE) + 8)
    for ids, parents in ((prompt, tree.chain(prefix).tolist()), (tokens, TREE)):
        past, t = cache.length, len(ids)
        out = session.forward(cache, np.array([ids]), (past + tree.depths(parents))[None], tree.ancestor_mask(parents),
                              np.arange(t),
                              want=("accept_rows", "bonus_token", "medusa_tokens"))
        cache.advance(t)
    alone = heads_session.run(None, {"hidden": hidden[ref.path[-1]][None].astype(heads_session_dtype(heads_session))})[0]
    return {"accepted": len(ref.path) - 1,
            "path_match": out["accept_rows"].tolist() == ref.path,
            "bonus_match": int(out["bonus_token"][0]) == ref.tokens[-1],
            **_candidates("fused", out["medusa_tokens"][0], ref_heads),
            **_candidates("heads_graph", alone[0], ref_heads)}


def heads_session_dtype(session):
    return np.float16 if session.get_inputs()[0].type == "tensor(float16)" else np.float32


def _candidates(name: str, got: np.ndarray, ref_logits: np.ndarray) -> dict:
    """Share of candidates [heads, k] equal to the reference top-k, and the worst logit gap where not."""
    k = got.shape[-1]
    want = np.argsort(-ref_logits, axis=-1, kind="stable")[:, :k]
    gap = np.abs(np.take_along_axis(ref_logits, got, -1) - np.take_along_axis(ref_logits, want, -1))
    return {f"{name}_top{k}_match": float((got == want).mean()), f"{name}_max_gap": float(gap.max())}


def eagle(model, session, draft_session, draft, seed: int = 0, prefix: int = 16) -> dict:
    """EAGLE's two graphs against PyTorch. The target's `eagle_features` on a prompt vs transformers' hidden
    states (through the draft's fc for EAGLE-3); then the draft graph vs `DraftModule.step` on those features:
    a chain of pairs (as after a prefill), then a branching tree of nodes fed the chain's output hiddens. Reports
    the max abs differences and the share of top-k draft tokens that match."""
    import torch

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, model.config.vocab_size, size=prefix)
    last = []  # the last layer's output before the final norm (an MTP draft's feature)
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, out: last.append(out[0] if isinstance(out, tuple)
                                                                                        else out))
    try:
        with torch.no_grad():
            states = model.model(input_ids=torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    embed = module_weight(model, "model.embed_tokens.")
    module = DraftModule.from_draft(draft, embed, module_weight(model, "lm_head."))
    with torch.no_grad():
        if draft.config.version == 3:
            ref_feats = module.start(torch.cat([states[i] for i in draft.config.aux_layers], -1).float())[0].numpy()
        else:
            ref_feats = (last[-1] if draft.config.prenorm_feature else states[-1])[0].float().numpy()
    cache = session.new_cache(prefix + 4)
    feats = session.forward(cache, ids[None], np.arange(prefix)[None], tree.causal_mask(prefix), np.array([prefix - 1]),
                            want=("eagle_features",))["eagle_features"][0].astype(np.float32)
    report = {"feature_max_abs_diff": float(np.abs(feats - ref_feats).max())}

    # the draft: pairs (feature t, token t + 1) for t < prefix - 1, then a tree below the last pair
    hot = draft.hot_ids
    dcache = draft_session.new_cache(prefix + len(TREE) + 4)
    past_kv, diffs, matches = None, [], []
    tokens, hidden, parents = ids[1:], ref_feats[:-1], tree.chain(prefix - 1).tolist()
    positions = np.arange(prefix - 1)
    for _ in range(2):
        past = dcache.length
        bias = tree.attention_bias(parents, past)
        got = draft_session.forward(dcache, np.array([tokens]), positions[None], tree.ancestor_mask(parents),
                                    np.arange(len(tokens)),
                                    want=("hidden_out", "draft_logp", "draft_tokens"), inputs={"hidden": hidden[None]})
        dcache.advance(len(tokens))
        with torch.no_grad():
            ref_out, logits, past_kv = module.step(torch.from_numpy(np.array([tokens])), torch.from_numpy(hidden[None]).float(),
                                                   torch.from_numpy(positions[None]),
                                                   torch.from_numpy(bias), past_kv)
            top = torch.log_softmax(logits[0], -1).topk(got["draft_tokens"].shape[1], -1)
        diffs += [float(np.abs(got["hidden_out"][0] - ref_out[0].numpy()).max()),
                  float(np.abs(got["draft_logp"] - top.values.numpy()).max())]
        matches.append(float((got["draft_tokens"] == hot[top.indices.numpy()]).mean()))
        # next: a branching tree below the last pair, every node fed that pair's output hidden
        tokens = rng.integers(3, model.config.vocab_size, size=len(TREE))
        hidden = np.repeat(ref_out[0, -1:].numpy(), len(TREE), 0)
        parents, positions = TREE, prefix - 1 + tree.depths(TREE)
    report.update(draft_max_abs_diff=max(diffs), draft_topk_match=min(matches))
    return report


def dflash(model, session, draft_session, draft, seed: int = 0, prefix: int = 16) -> dict:
    """DFlash's two graphs against PyTorch: the target's `dflash_context` on a prompt vs hidden_norm(fc(...)) of
    transformers' hidden states; then the draft graph vs `DFlashModule.block`, twice: the prompt's context rows and
    a block after them, then a few more context rows and the next block (the first call's context rows cached)."""
    import torch

    from specexport.exporter.dflash import DFlashModule

    c = draft.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, model.config.vocab_size, size=prefix)
    with torch.no_grad():
        states = model.model(input_ids=torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states
    module = DFlashModule(draft, module_weight(model, "model.embed_tokens."), module_weight(model, "lm_head."))
    with torch.no_grad():
        ref_ctx = module.context(torch.cat([states[i] for i in c.target_layers], -1).float())[0]
    cache = session.new_cache(prefix + 4)
    got_ctx = session.forward(cache, ids[None], np.arange(prefix)[None], tree.causal_mask(prefix), np.array([prefix - 1]),
                              want=("dflash_context",))["dflash_context"][0].astype(np.float32)
    report = {"context_max_abs_diff": float(np.abs(got_ctx - ref_ctx.numpy()).max())}
    dcache = draft_session.new_cache(prefix + 2 * c.block)
    diffs, matches, fed = [], [], 0
    for upto in (prefix - 4, prefix - 1):  # context rows fed so far; the block's first row is token `upto`
        m, b = upto - fed, c.block
        block = [int(ids[upto])] + [c.mask_token] * (b - 1)
        mask = np.tril(np.ones((m + b, m + b), bool))
        mask[m:] = True
        context = np.concatenate([got_ctx[fed:upto], np.zeros((b, c.hidden), np.float32)])[None]
        got = draft_session.forward(dcache, np.array([list(ids[fed:upto]) + block]), (fed + np.arange(m + b))[None],
                                    mask, np.arange(m + 1, m + b), want=("draft_logp", "draft_tokens"),
                                    inputs={"context": context, "context_rows": (np.arange(m + b) < m)[None]})
        dcache.advance(m)
        fed = upto
        with torch.no_grad():
            top = module.block(torch.from_numpy(got_ctx[:upto]), block, upto).topk(got["draft_tokens"].shape[1], -1)
        diffs.append(float(np.abs(got["draft_logp"] - top.values.numpy()).max()))
        matches.append(float((got["draft_tokens"] == top.indices.numpy()).mean()))
    report.update(draft_max_abs_diff=max(diffs), draft_topk_match=min(matches))
    return report
