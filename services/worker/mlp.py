"""The MLP kinds a layer plan names: dense gated MLPs (SwiGLU, GeGLU) and a top-k mixture of them.

A mixture of experts routes each token to `experts_per_token` experts by the softmax of the
router's logits (renormalised over the chosen ones where the plan says so), then computes each
expert once over all the tokens routed to it: the (token, choice) pairs are sorted by expert, so
each expert's rows are one contiguous slice of one gathered matrix and one matmul per expert
serves them. The weighted rows are summed back into their tokens with one index_add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vmesh.services.common.families.plan import MlpPlan, WeightNames
from vmesh.services.worker.quantized_linear import QuantizedLinear, is_plain_quantized

if TYPE_CHECKING:
    from vmesh.services.worker.int8_linear import Int8Linear
    from vmesh.services.worker.linear import Linear
    from vmesh.services.worker.model import FusedOps, WeightSource
    from vmesh.services.worker.quantized_linear import QuantizedWeight

    AnyLinear = Linear | QuantizedLinear | Int8Linear  # what a model's linear factory builds
    LinearFactory = Callable[..., AnyLinear]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * inter] (gate, up) -> gelu_tanh(gate) * up (GeGLU), computed in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


class DenseMlp:
    def __init__(self, plan: MlpPlan, gate_up: AnyLinear, down: AnyLinear):
        self.plan = plan
        self.gate_up_proj = gate_up  # gate and up in one matmul
        self.down_proj = down

    @classmethod
    def load(cls, plan: MlpPlan, weights: WeightSource, prefix: str, names: WeightNames,
             linear: LinearFactory) -> DenseMlp:
        def weight(*parts: str) -> torch.Tensor | QuantizedWeight:
            return weights.take_linear(*(f"{prefix}{names.mlp.format(p)}.weight" for p in parts))

        return cls(plan, linear(weight("gate", "up")), linear(weight("down")))

    def projections(self) -> list[AnyLinear]:
        return [self.gate_up_proj, self.down_proj]

    def __call__(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        return self._from_gate_up(self.gate_up_proj(x), ops)

    def takes_norm(self, ops: FusedOps) -> bool:
        """Whether after_rms_norm runs the norm inside gate_up's C call (model.FusedOps.into_quantized_linear)."""
        return ops.into_quantized_linear and is_plain_quantized(self.gate_up_proj)

    def after_rms_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor,
                       ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(ops.rms_norm(x, norm_weight, eps, residual)[0]), the residual updated in place), the norm
        inside gate_up's call (where takes_norm)."""
        gate_up, residual = self.gate_up_proj.after_rms_norm(x, norm_weight, eps, residual)  # type: ignore[union-attr]
        return self._from_gate_up(gate_up, ops), residual

    def _from_gate_up(self, gate_up: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        if self.plan.activation != "silu":
            return self.down_proj(gelu_tanh_and_mul(gate_up))
        if ops.into_quantized_linear and is_plain_quantized(self.down_proj) and gate_up.dim() == 2:
            return self.down_proj.after_silu_and_mul(gate_up)
        return self.down_proj(ops.silu_and_mul(gate_up))


class MixtureOfExperts:
    def __init__(self, plan: MlpPlan, router: torch.Tensor, experts: list[DenseMlp]):
        self.plan = plan
        self.router = router  # [experts, hidden]
        self.experts = experts

    @classmethod
    def load(cls, plan: MlpPlan, weights: WeightSource, prefix: str, names: WeightNames,
             linear: LinearFactory) -> MixtureOfExperts:
        """Experts stacked in two tensors (transformers >= 5) or one module each (older checkpoints)."""
        router = weights.take(prefix + names.router)
        experts = []
        if prefix + names.experts_gate_up in weights:
            gate_up, down = weights.take(prefix + names.experts_gate_up), weights.take(prefix + names.experts_down)
            for e in range(plan.num_experts):
                experts.append(DenseMlp(plan, linear(gate_up[e].contiguous()), linear(down[e].contiguous())))
        else:
            gate_part, up_part, down_part = names.expert_parts
            for e in range(plan.num_experts):
                def weight(*parts: str, e: int = e) -> torch.Tensor | QuantizedWeight:
                    return weights.take_linear(*(prefix + names.expert.format(e, p) for p in parts))

                experts.append(DenseMlp(plan, linear(weight(gate_part, up_part)), linear(weight(down_part))))
        return cls(plan, router, experts)

    def projections(self) -> list[AnyLinear]:
        return [p for expert in self.experts for p in expert.projections()]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in x's dtype, expert ids [tokens, k]) as transformers routes: the
        float32 softmax of the router's logits, its top k, optionally renormalised."""
        probs = F.linear(x, self.router.to(x.dtype)).float().softmax(-1)
        weights, chosen = probs.topk(self.plan.experts_per_token, dim=-1)
        if self.plan.normalize_routing:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def __call__(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        weights, chosen = self.route(x)
        k = self.plan.experts_per_token
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // k
        rows = x[tokens]
        out_rows = torch.empty(len(order), x.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                out_rows[start:start + count] = expert(rows[start:start + count], ops)
                start += count
        out_rows *= weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)


def load_mlp(plan: MlpPlan, weights: WeightSource, prefix: str, names: WeightNames,
             linear: LinearFactory) -> DenseMlp | MixtureOfExperts:
    return (MixtureOfExperts if plan.is_moe else DenseMlp).load(plan, weights, prefix, names, linear)
