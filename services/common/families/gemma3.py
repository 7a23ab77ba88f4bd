"""Gemma 3 (text): local sliding-window layers interleaved with global ones, each kind with its
own RoPE base; QK-norm; a norm before and after both attention and the MLP (sandwich); GeGLU;
embeddings scaled by sqrt(hidden); RMSNorm weights stored as offsets from one; scores scaled by
query_pre_attn_scalar ** -0.5.

Its chat format: turns of `user` and `model` (the assistant), each between <start_of_turn> and
<end_of_turn>; no system role, so a leading system message opens the first user turn."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import (
    AttentionPlan,
    Family,
    LayerPlan,
    MlpPlan,
    ModelPlan,
    UnsupportedModelError,
    activation,
    layer_windows,
    refuse_set,
    rope_parameters,
)


def plan(config: Any) -> ModelPlan:
    refuse_set(config, "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")
    if getattr(config, "attention_bias", False):
        raise UnsupportedModelError("config field attention_bias = True is not supported for Gemma 3")
    mlp = MlpPlan(config.intermediate_size, activation(config, "hidden_activation"))
    scale = float(config.query_pre_attn_scalar) ** -0.5
    layers = []
    for window in layer_windows(config):
        theta, scaling = rope_parameters(config, "sliding_attention" if window else "full_attention")
        layers.append(LayerPlan(AttentionPlan(theta, scaling, window, qk_norm=True, scale=scale), mlp,
                                norms="sandwich"))
    return ModelPlan(tuple(layers), embedding_scale=config.hidden_size ** 0.5, norm_weight_offset=1.0)


# Whitespace control (`-`) everywhere: the template's own line breaks are not the format's.
TURNS_TEMPLATE = """\
{{- bos_token -}}
{%- set turns = messages -%}
{%- set preamble = namespace(text="") -%}
{%- if turns and turns[0]["role"] == "system" -%}
  {%- set preamble.text = (turns[0]["content"] or "") ~ "\n\n" -%}
  {%- set turns = turns[1:] -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if message["role"] not in ("user", "assistant") -%}
    {{- raise_exception("Gemma 3 takes user and assistant turns (and one system message first), not "
                        ~ message["role"]) -}}
  {%- endif -%}
  {{- "<start_of_turn>" ~ ("model" if message["role"] == "assistant" else "user") ~ "\n" -}}
  {%- if loop.first -%}{{- preamble.text -}}{%- endif -%}
  {{- (message["content"] or "") | trim -}}
  {{- "<end_of_turn>\n" -}}
{%- else -%}
  {%- if preamble.text -%}{{- "<start_of_turn>user\n" ~ preamble.text | trim ~ "<end_of_turn>\n" -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<start_of_turn>model\n" -}}{%- endif -%}
"""

FAMILY = Family("Gemma3ForCausalLM", "gemma3_text", plan, chat_template=TURNS_TEMPLATE, end_of_turn="<end_of_turn>")
