"""transformers' own model as the validation reference of a checkpoint too big to hold in fp32: each weighted module
(the embedding, every decoder layer, the final norm, the LM head) reads its weights from the checkpoint when it runs
and drops them when it is done, so a forward holds one layer's fp32 weights at a time and computes exactly what the
whole model computes. It is slow per forward (it reads the checkpoint each time), so validation asks it for few
forwards (validate.check_graph).

Example: `model = layerwise_model(SafetensorsSource(folder), config)`; `model(input_ids=ids).logits` as from_pretrained's fp32 model.
"""

from __future__ import annotations

import torch

# fp32 reference bytes above which an export validates against the layer-wise model instead of loading it whole
WHOLE_REFERENCE_BYTES = 2 << 30


def _units(model) -> dict[str, torch.nn.Module]:
    """The modules that own parameters, by their state-dict prefix: embedding, each layer, the norm, the LM head."""
    units = {"model.embed_tokens.": model.model.embed_tokens, "model.norm.": model.model.norm,
             "lm_head.": model.lm_head}
    units.update({f"model.layers.{i}.": layer for i, layer in enumerate(model.model.layers)})
    return units


def _drop(module: torch.nn.Module) -> None:
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=False)


def layerwise_model(source, config):
    """The fp32, eval-mode transformers model of `config` over a checkpoint read a tensor at a time (`source`, by
    transformers' names: sources.stream_source), its weights
    read per module per forward (module docstring). Its non-persistent buffers (RoPE, Gemma's embedding scale) are
    computed on the CPU at construction, as from_pretrained computes them."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def loader(prefix: str):
        def load(module, args, kwargs=None):
            state = {}
            for name, p in module.named_parameters():
                source_name = "model.embed_tokens.weight" if tied and prefix == "lm_head." else prefix + name
                state[name] = torch.from_numpy(source.get(source_name))
            module.load_state_dict(state, strict=False, assign=True)  # its persistent buffers, if any, stay
        return load

    units = _units(model)
    loose = [name for name, _ in model.named_parameters() if not any(name.startswith(p) for p in units)]
    if loose:
        raise ValueError(f"layer-wise reference: parameters outside the embedding, layers, norm and LM head: {loose[:3]}")
    for prefix, module in units.items():
        module.register_forward_pre_hook(loader(prefix))
        module.register_forward_hook(lambda module, args, out: _drop(module))
    model.layerwise_weight = lambda name: torch.from_numpy(source.get(
        "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name))
    return model


def module_weight(model, prefix: str) -> torch.Tensor:
    """A unit's weight (`lm_head.` or `model.embed_tokens.`) as a real fp32 tensor, of a whole or a layer-wise model."""
    if hasattr(model, "layerwise_weight"):
        return model.layerwise_weight(prefix + "weight")
    module = model.get_output_embeddings() if prefix == "lm_head." else model.get_input_embeddings()
    return module.weight.detach().float()
