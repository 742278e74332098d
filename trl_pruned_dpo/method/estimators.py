"""The estimators: inverse-probability (Horvitz-Thompson) weighting and straight-through branch scaling.

Pure functions of tensors. The trainer feeds their outputs to TRL's own loss code, so every TRL loss sees unbiased
estimates of the per-branch sums it is a function of (docs/method.md).
"""

import torch


def horvitz_thompson(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token terms of D^_b = sum_t (1[kept_t] / pi_t) * d_t (Eqs. 1-2); `weights` is 0 where t was not kept.

    Summing the result over a row gives an unbiased estimate of the row's full sum. Unkept positions hold 0 (never a
    NaN from an unscored position: `where`, not a product, drops them).
    """
    return torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token))


def scale_branch_gradient(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_eff = x.detach() + s * (x - x.detach()) per row, s = z_b / p_br (Eq. 3).

    The value is unchanged; the gradient flowing into row b is multiplied by s. `scale` has one entry per row.
    """
    scale = scale.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))
    detached = values.detach()
    return detached + scale * (values - detached)
