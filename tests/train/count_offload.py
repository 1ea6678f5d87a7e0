"""`--experimental.custom_import tests.train.count_offload`: torch's save_on_cpu replaced by a
subclass that counts what it packs and prints, at each exit, "packed N" (N: the tensors packed
so far in this process), so a silently skipped offload shows as no such line.

The trainer looks save_on_cpu up on torch.autograd.graph when it builds the step's context, so
the patch holds for a trainer imported before it.
"""

import torch
from torch.autograd.graph import save_on_cpu

packed = [0]


class Counting(save_on_cpu):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        def counted(tensor):
            packed[0] += 1
            return pack(tensor)

        self.pack_hook = counted

    def __exit__(self, *args):
        super().__exit__(*args)
        print("packed", packed[0], flush=True)


torch.autograd.graph.save_on_cpu = Counting
