"""In-place healing: torchft replica groups (`[ft]`, docs/operations.md#in-place-healing).

Each replica group is a whole copy of the layout, started as its own `fivefold train` job; a torchft
lighthouse forms a quorum of the live groups before every step, the groups reduce their gradients
through torchft's process group, and a restarted group takes the training state from a live peer.
The model, the dimensions and the trainer know nothing of it; this room holds all of it:

- need.py: torchft imported, or one sentence naming the `[ft]` extra;
- share.py: which micro-batches of a step a group and rank run, and what its gradient weighs;
- state.py: what a healing group copies from a live peer, and how it loads it;
- group.py: one replica group's training loop (quorum, step, cross-group reduction, commit);
- supervise.py: `fivefold train --ft.replicas R` on one machine: a lighthouse and R groups, each
  started again when it dies.
"""
