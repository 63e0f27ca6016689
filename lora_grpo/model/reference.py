"""Syncing the reference slot to the policy: iterative GRPO for the price of the adapter tensors.

Modes (alpha in (0, 1]; alpha = 1 is an exact copy in both):

- "exact": ΔW_ref ← α·ΔW_policy + (1−α)·ΔW_ref in weight space. The mix is a low-rank matrix
  L·R with L = [√α·s_p·B_p | √(1−α)·s_r·B_r] (out, k) and R = [√α·A_p ; √(1−α)·A_r] (k, in),
  k = r_p + r_r. With L = Q_L·R_L and Rᵀ = Q_R·R_R (thin QR), L·R = Q_L·(R_L·R_Rᵀ)·Q_Rᵀ, so the
  SVD of the small k × k core gives the SVD of the mix; the top r_ref directions are kept. The
  relative Frobenius norm of what was dropped, √(Σ_{i>r} σ_i²) / √(Σ σ_i²), is reported.
- "factors": A_ref ← α·A_p + (1−α)·A_ref and B_ref ← α·(s_p/s_r)·B_p + (1−α)·B_ref, name by name.
  This is what a parameter EMA does, and it is NOT a weight-space mix: the product of blended
  factors has cross terms α(1−α)(B_p·A_r + B_r·A_p). Cheap, approximate; never the default.

Each adapter's scaling (lora_alpha / r, or / √r with rsLoRA) is folded into the factors. Each
mode is one record in SYNC_MODES; config.py names the same keys (a test checks they agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..device import now
from .adapters import POLICY, REFERENCE, lora_layers

# peft's LoRA variants whose layers still compute x·ΔWᵀ with ΔW = scaling·B·A (VeLoRA only compresses what the
# backward keeps), so the reference slot mirrors them exactly.
SYNCABLE_VARIANTS = ("VeloraLinearVariant",)


def check_syncable(model: nn.Module, policy: str = POLICY, reference: str = REFERENCE) -> None:
    """Refuse adapters that a sync would only half copy: DoRA and peft's other LoRA variants, trained biases,
    modules_to_save, embeddings."""
    from peft.tuners.lora import LoraLayer

    cfg = model.peft_config[policy]
    problems = []
    if getattr(cfg, "use_dora", False):
        problems.append("DoRA (use_dora=True): its magnitude vector is not part of ΔW = B·A")
    if getattr(cfg, "bias", "none") != "none" or getattr(cfg, "lora_bias", False):
        problems.append(f"trained biases (bias={cfg.bias!r}, lora_bias={getattr(cfg, 'lora_bias', False)})")
    if getattr(cfg, "modules_to_save", None):
        problems.append(
            f"modules_to_save={cfg.modules_to_save}: fully trained modules outside the LoRA factors"
        )
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and policy in getattr(module, "lora_embedding_A", {}):
            problems.append(f"an embedding LoRA at {name}")
            break
    variants = {
        type(variant).__name__
        for module in model.modules()
        if isinstance(module, LoraLayer)
        and (variant := getattr(module, "lora_variant", {}).get(policy)) is not None
        and type(variant).__name__ not in SYNCABLE_VARIANTS
    }
    if variants and not getattr(cfg, "use_dora", False):
        problems.append(
            f"peft's LoRA variant {', '.join(sorted(variants))}: its layers compute other than x·ΔWᵀ with ΔW = B·A "
            "(aLoRA only after its invocation tokens, BD-LoRA with block-diagonal factors, ...), which the "
            "reference slot's plain LoRA cannot mirror"
        )
    if problems:
        raise ValueError(
            "the policy adapter cannot be synced into the reference slot exactly: "
            + "; ".join(problems)
            + ". Use a plain LoRA adapter (no DoRA or other variant, bias='none', no modules_to_save, linear targets "
            "only)."
        )
    missing = [n for n, m in lora_layers(model, (policy,)) if reference not in m.lora_A]
    if missing:
        raise ValueError(f"the reference slot does not cover every policy LoRA layer, e.g. {missing[:3]}")


def _factors(module: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    return module.lora_B[adapter].weight, module.lora_A[adapter].weight, float(module.scaling[adapter])


def delta_weight(module: nn.Module, adapter: str) -> torch.Tensor:
    """Dense ΔW = scaling · B · A (out, in), float32."""
    B, A, s = _factors(module, adapter)
    return s * (B.float() @ A.float())


def exact_mix(B_p, A_p, s_p, B_r, A_r, s_r, alpha: float, rank: int):
    """Weight-space mix α·s_p·B_p·A_p + (1−α)·s_r·B_r·A_r, recompressed to `rank`.

    B_* (..., out, r_*), A_* (..., r_*, in), s_* floats or (...,) tensors; leading dims batch
    layers of one shape. Returns (B (..., out, rank), A (..., rank, in), dropped² (...),
    total² (...)): B·A is the best rank-`rank` approximation of the mix (Eckart–Young), with
    scaling 1 (divide B by s_r to store it in the slot).
    """

    def scale(s):  # a float or (...,) → broadcastable over (..., rows, cols)
        return torch.as_tensor(s, dtype=torch.float32, device=B_p.device)[..., None, None]

    L = torch.cat(
        [math.sqrt(alpha) * scale(s_p) * B_p.float(), math.sqrt(1 - alpha) * scale(s_r) * B_r.float()], dim=-1
    )
    R = torch.cat([math.sqrt(alpha) * A_p.float(), math.sqrt(1 - alpha) * A_r.float()], dim=-2)
    q_l, r_l = torch.linalg.qr(L)  # (..., out, k), (..., k, k)
    q_r, r_r = torch.linalg.qr(R.mT)  # (..., in, k), (..., k, k)
    u, sigma, vh = torch.linalg.svd(r_l @ r_r.mT)
    keep = min(rank, sigma.shape[-1])
    root = sigma[..., :keep].sqrt()
    B = L.new_zeros(*L.shape[:-1], rank)
    A = R.new_zeros(*R.shape[:-2], rank, R.shape[-1])
    B[..., :keep] = (q_l @ u[..., :keep]) * root[..., None, :]  # √σ on both sides: balanced factors
    A[..., :keep, :] = root[..., :, None] * (vh[..., :keep, :] @ q_r.mT)
    return B, A, sigma[..., keep:].square().sum(-1), sigma.square().sum(-1)


def _copy(B_p, A_p, s_p, B_r, A_r, s_r) -> None:
    # The policy's factors into the first r_p slots, zeros after: ΔW_ref = ΔW_policy exactly.
    r_p = A_p.shape[0]
    if A_r.shape[0] < r_p:
        raise ValueError(f"reference slot rank {A_r.shape[0]} < policy rank {r_p}: cannot copy exactly")
    B_r.zero_()
    A_r.zero_()
    B_r[:, :r_p] = (s_p / s_r) * B_p
    A_r[:r_p] = A_p


def _blend_factors(B_p, A_p, s_p, B_r, A_r, s_r, alpha: float) -> None:
    if A_r.shape != A_p.shape:
        raise ValueError("mode 'factors' needs the reference slot's rank to equal the policy's")
    A_r.mul_(1 - alpha).add_(A_p, alpha=alpha)
    B_r.mul_(1 - alpha).add_(B_p, alpha=alpha * s_p / s_r)


Pairs = list[tuple[tuple, tuple]]  # [((B_p, A_p, s_p), (B_r, A_r, s_r)), ...]: one per LoRA layer


def _sync_exact(pairs: Pairs, alpha: float) -> tuple[float, float]:
    """Exact mix, layer by layer; returns (truncation_error, max_layer_error).

    (Batching layers of one shape into one QR/SVD call measured slower on CPU and held 250 MB of
    temporaries on a 0.5B model; one layer at a time keeps the peak at one layer's factors.)
    """
    if not pairs:
        return 0.0, 0.0
    dropped, energy = [], []
    for (B_p, A_p, s_p), (B_r, A_r, s_r) in pairs:
        B, A, d, e = exact_mix(B_p, A_p, s_p, B_r, A_r, s_r, alpha, A_r.shape[0])
        B_r.copy_(B / s_r)
        A_r.copy_(A)
        dropped.append(d)
        energy.append(e)
    dropped, energy = (
        torch.stack(dropped),
        torch.stack(energy),
    )  # one host sync for all layers, not one per layer
    if energy.sum() == 0:
        return 0.0, 0.0
    error = (dropped.sum() / energy.sum()).sqrt().item()
    worst = (dropped / energy.clamp(min=torch.finfo(energy.dtype).tiny)).sqrt().max().item()
    return error, worst


def _sync_factors(pairs: Pairs, alpha: float) -> tuple[float, float]:
    for p, r in pairs:
        _blend_factors(*p, *r, alpha)
    return 0.0, 0.0  # approximate by design; nothing is truncated


@dataclass(frozen=True)
class SyncMode:
    """One ref_sync_mode: how a soft sync (0 < alpha < 1) moves the reference slot towards the policy."""

    blend: Callable[
        [Pairs, float], tuple[float, float]
    ]  # (pairs, alpha) → (truncation_error, max_layer_error)
    help: str


SYNC_MODES: dict[str, SyncMode] = {
    "exact": SyncMode(
        _sync_exact, "weight-space mix α·ΔW_policy + (1−α)·ΔW_ref, recompressed to the slot's rank"
    ),
    "factors": SyncMode(_sync_factors, "blend A and B name by name, like a parameter EMA (approximate)"),
}


@torch.no_grad()
def sync_reference(
    model: nn.Module, alpha: float, mode: str = "exact", policy: str = POLICY, reference: str = REFERENCE
) -> dict[str, float]:
    """Move the reference slot towards the policy; returns flat metrics (sync/*).

    sync/truncation_error is the relative Frobenius norm of what recompression dropped, over all
    layers together: √(Σ dropped²) / √(Σ ‖ΔW_mix‖²) (0 for a copy, for "factors", or when the
    mixed rank fits in the slot); sync/max_layer_error is the worst single layer's.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha={alpha} must be in (0, 1]")
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown sync mode {mode!r}; choose one of {list(SYNC_MODES)}")
    pairs = [
        (_factors(m, policy), _factors(m, reference)) for _, m in lora_layers(model, (policy, reference))
    ]
    # The sync's kernels run asynchronously on a GPU: a clock that waits for them (device.now), or
    # sync/seconds would time the launches and the next stage would pay for the work.
    device = pairs[0][0][0].device if pairs else torch.device("cpu")
    start = now(device)
    error = worst = 0.0
    if alpha == 1.0:  # an exact copy in every mode
        for p, r in pairs:
            _copy(*p, *r)
    else:
        error, worst = SYNC_MODES[mode].blend(pairs, alpha)
    return {
        "sync/alpha": float(alpha),
        "sync/truncation_error": error,
        "sync/max_layer_error": worst,
        "sync/seconds": now(device) - start,
    }


@dataclass
class SyncSchedule:
    """When to sync: every N optimizer steps, at epoch boundaries, when the KL passes a threshold, or
    when the eval score stalls (plateau; ProRL's trigger, Liu et al. 2025).

    Whether any sync is configured at all is GRPOConfig.sync_enabled (one source of truth). The
    plateau trigger keeps state (the best eval score so far and how many evals in a row have not
    beaten it by min_delta): `observe_eval` feeds it each eval, `synced` restarts the count after a
    sync that the plateau made due, and `state_dict` / `load_state_dict` carry it in checkpoints.
    """

    every_steps: int = 0
    every_epoch: bool = False
    kl_threshold: float | None = None
    plateau_patience: int = 0  # 0 = no plateau trigger
    plateau_min_delta: float = 0.0
    best_eval: float | None = None  # plateau state: the best score seen
    evals_without_improvement: int = 0  # plateau state: evals since it was set

    @classmethod
    def from_config(cls, config) -> "SyncSchedule":
        patience = config.ref_sync_plateau_patience if config.ref_sync_on_plateau else 0
        return cls(
            config.ref_sync_steps,
            config.ref_sync_every_epoch,
            config.ref_sync_kl,
            patience,
            config.ref_sync_plateau_min_delta if patience else 0.0,
        )

    def observe_eval(self, score: float) -> None:
        """One eval's score (higher is better). It improves when it beats the best by more than
        min_delta (the first finite score sets the best); a NaN score never improves."""
        if not self.plateau_patience:
            return
        if math.isfinite(score) and (
            self.best_eval is None or score > self.best_eval + self.plateau_min_delta
        ):
            self.best_eval, self.evals_without_improvement = score, 0
        else:
            self.evals_without_improvement += (
                1  # as Keras' EarlyStopping: a smaller rise leaves the best as it was
            )

    @property
    def plateau_due(self) -> bool:
        return self.plateau_patience > 0 and self.evals_without_improvement >= self.plateau_patience

    def synced(self) -> None:
        """After any sync: a plateau that was due is consumed (its count restarts; the best stays)."""
        if self.plateau_due:
            self.evals_without_improvement = 0

    def state_dict(self) -> dict:
        return {"best_eval": self.best_eval, "evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best_eval = state.get("best_eval")
        self.evals_without_improvement = int(state.get("evals_without_improvement", 0))

    def due(self, step: int, epoch_ended: bool = False, kl: float | None = None) -> str | None:
        """The reason to sync after optimizer step `step` (1-based), or None: every trigger that
        fires, in the order steps, epoch, kl, plateau, joined by '+' (e.g. 'steps+plateau')."""
        fired = [
            reason
            for reason, fires in (
                ("steps", self.every_steps > 0 and step % self.every_steps == 0),
                ("epoch", self.every_epoch and epoch_ended),
                ("kl", self.kl_threshold is not None and kl is not None and kl > self.kl_threshold),
                ("plateau", self.plateau_due),
            )
            if fires
        ]
        return "+".join(fired) or None
