"""The MLP job with a checkpoint folder of each node's own (node0, node1, ... by RANK), as on
a cluster whose nodes have local disks: only rank 0's folder ever holds checkpoints."""
import os

from mlp import job

job.checkpoint_dir = os.path.join(os.environ.get("CKPT_BASE", "runs/node-local"), f"node{os.environ.get('RANK', '0')}")
