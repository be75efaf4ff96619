"""torch's PipelineStage, telling fivefold when each micro-batch passes through it.

The pipeline acts at four moments of a micro-batch on a stage: before its forward (select its
positions, document ids and targets), when the sends of
its output are built (the output's data can go), when a V schedule hands it another stage's
output on this rank (kept in two places), and when its backward on this stage is over (a full
backward, or the weight pass of a split one; its input pass keeps the graph). A subclass overrides
the methods the schedules call (torch_internals STAGE_METHODS; torch_internals/checks.py checks
the schedules still call them and `backward_one_chunk`'s signature) and calls the listeners each
moment has; it also clocks the compute actions (the measured bubble). parallel/pipeline/stages.py
registers what happens at each moment.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from torch.distributed.pipelining import PipelineStage


class ObservedStage(PipelineStage):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.before_forward: list = []  # f(micro-batch)
        self.sends_built: list = []  # f(micro-batch, send ops)
        self.local_input: list = []  # f(micro-batch, the other stage's outputs)
        self.backward_done: list = []  # f(micro-batch)
        self.busy_s = 0.0  # seconds inside forward and backward actions since the last take

    @contextmanager
    def _clocked(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        for listener in self.before_forward:
            listener(fwd_chunk_id)
        with self._clocked():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with self._clocked():
            result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:
            for listener in self.backward_done:
                listener(bwd_chunk_id)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self._clocked():
            result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        for listener in self.backward_done:
            listener(bwd_chunk_id)
        return result

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        for listener in self.sends_built:
            listener(fwd_chunk_id, ops)
        return ops

    def set_local_fwd_input(self, prev_stage_outputs, mb_index):
        super().set_local_fwd_input(prev_stage_outputs, mb_index)
        for listener in self.local_input:
            listener(mb_index, prev_stage_outputs)
