"""Helpers the tests share by import (conftest holds the fixtures): a tiny ShareGPT-format file, a free port."""

import json
import random
import socket

from specexport.train.data import HELDOUT

WORDS = "the a sea ship wind sails over blue waves and calm night stars shine on quiet water far away".split()
TRAIN_CONVERSATIONS = 12


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_sharegpt(path, train=TRAIN_CONVERSATIONS, heldout=HELDOUT, truncate=True):
    """A ShareGPT-format JSON list: `train` conversations, then the `heldout` ones, then (if `truncate`) a
    conversation cut off mid-string, as in the real file."""
    rng = random.Random(0)
    items = [{"id": f"c{i}", "conversations": [{"from": "human", "value": sentence(rng, 5)},
                                               {"from": "gpt", "value": sentence(rng, 12)}]}
             for i in range(train + heldout)]  # fmt: skip
    text = json.dumps(items, indent=1)
    if truncate:
        text = text[:-2] + ',\n{"id": "cut", "conversations": [{"from": "human", "value": "The sea'
    path.write_text(text)
    return path


def free_port() -> int:
    """A TCP port free on loopback now (for servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
