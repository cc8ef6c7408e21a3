"""Where a Python object holding ebbtide's native objects was made (Note
[Objects across fork] in cpp/include/ebbtide/mem/fork_origin.hpp): the fork
generation the bindings compare, so that a forked child leaves the parent's
caches, writers and saves alone, and the process id for messages."""
import os

from ebbtide import _core


class Origin:
    __slots__ = ("pid", "generation")

    def __init__(self):
        self.pid = os.getpid()
        self.generation = _core.fork_generation()

    def here(self, _generation=_core.fork_generation) -> bool:
        """Made by this process (not a forked child's copy of the parent's).
        The function is bound at definition: a __del__ at interpreter exit
        may run after the module's globals are cleared."""
        return self.generation == _generation()
