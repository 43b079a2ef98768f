"""The documented door to a checkpoint directory's lock: ``release_directory(directory)``
(docs/prepare.md names ``cpuddp.train.ckpt_lock.release_directory``, the path it had before train
had subpackages).  The lock itself is :mod:`cpuddp.train.checkpoint.ckpt_lock`; nothing in the
package imports this module.
"""

from __future__ import annotations

from .checkpoint.ckpt_lock import release_directory

__all__ = ["release_directory"]
