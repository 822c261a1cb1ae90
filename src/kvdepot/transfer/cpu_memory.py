"""Engine CPU memory shared with the server through POSIX shared memory.

The engine side (`kvdepot.client.memory_export`) moves its KV storage into shared memory
in place with torch's storage sharing; here the server opens the same pages by name.
"""

from __future__ import annotations

import numpy as np
import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import SharedCPUMemory


def open_shared_cpu(handle: SharedCPUMemory) -> tuple[torch.UntypedStorage, np.ndarray]:
    """Map the engine's allocation; returns the storage (keep it alive) and a byte view."""
    try:
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            handle.manager_handle, handle.shm_name, handle.nbytes)
    except RuntimeError as exc:
        raise InvalidRequest(
            f"cannot open the engine's shared memory {handle.shm_name!r}: {exc}. The server "
            "must run on the same machine as the engine and see the same /dev/shm"
        ) from exc
    array = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return storage, array
