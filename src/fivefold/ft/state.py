"""What a restarted replica group copies from a live peer to join at the next step: this rank's
weights, its optimizer state, the LR schedule and the data position (the step). torchft's
checkpoint transport moves it, rank r of the live group to rank r of the healing one, so both
groups must hold the same layout.

The state handed out is a copy: a peer may read it while this group goes on to its next step.
"""

from __future__ import annotations

import torch


class HealingState:
    def __init__(self, par, optimizer, scheduler, sampler):
        self.par, self.optimizer, self.scheduler, self.sampler = par, optimizer, scheduler, sampler
        self.healed_at: int | None = None  # the step this process took its state from a peer at

    def _weights(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{name}": param for i, part in enumerate(self.par.parts) for name, param in part.named_parameters()}

    def state_dict(self) -> dict:
        return {"weights": {name: p.detach().clone() for name, p in self._weights().items()},
                "optimizer": _cloned(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(),
                "data": self.sampler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        mine = self._weights()
        if mine.keys() != state["weights"].keys():  # not the same layout: refuse rather than mix
            raise RuntimeError("the peer's weights have other names than this group's; every replica group "
                               "must run the same config and layout")
        for name, param in mine.items():
            param.copy_(state["weights"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["data"])
        self.healed_at = self.sampler.step


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value
