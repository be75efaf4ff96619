"""Checkpoints: saving and resuming under any layout (save_load.py), each rank's pieces through
DCP (sharded_io.py, state_boxes.py, state_shapes.py), what a resume checks (resume_checks.py,
resume_optimizer.py, lora_base.py), the folders (step_folders.py, folder_lock.py, space.py,
manifest.py, bounds.py) and the storage's refusals in one sentence (save_failures.py,
load_failures.py)."""
