"""The collectives of checkpoint saves under torch.distributed (Note
[Checkpoint collectives]): the group they run on and the order in which the
ranks issue them. Used by native_save.py."""
import contextlib
import threading


# Note [Checkpoint collectives]
# Under torch.distributed the ranks agree on a save twice: rank 0 reserves
# the save's directories and broadcasts their names (reserve_directories),
# and in wait() every rank reports its outcome and rank 0 its commit
# (commit_across_ranks). Both are object collectives, which under NCCL move
# their pickles through CUDA tensors and make the host wait for the GPU: the
# training thread would wait for all the kernels queued before save(). So
# they run over a gloo group of all ranks, made once per default group on
# the first save (new_group is itself a collective: every rank makes it at
# the same point of the program, on the caller's thread), or over the
# default group where it already moves objects through host memory.
# A background snapshot (snapshot="background") also reserves on its own
# thread, so under torch.distributed save() returns without waiting for the
# other ranks either (a reservation error then comes from wait(), on every
# rank). Collectives on a group must be issued in one order on every rank;
# with reservations on snapshot threads beside the caller's waits, each
# save's reservation and each wait() takes a ticket on the caller's thread,
# in program order, and runs its collectives in ticket order.
class _Collectives:
    def __init__(self):
        self._cv = threading.Condition()
        self._issued = 0  # tickets handed out
        self._done = 0  # tickets whose collectives are over
        self._groups = None  # (default group, group of the checkpoint collectives: None = the default)

    def group(self, dist):
        """The group checkpoint collectives use (None: the default group).
        Collective when first called for a default group: on the caller's thread."""
        world = dist.group.WORLD
        if self._groups is None or self._groups[0] is not world:
            backend = str(dist.get_backend())
            on_cpu = backend == "gloo" or "cpu:gloo" in backend
            self._groups = (world, None if on_cpu else dist.new_group(backend="gloo"))
        return self._groups[1]

    def ticket(self):
        with self._cv:
            self._issued += 1
            return self._issued - 1

    @contextlib.contextmanager
    def turn(self, ticket):
        """Runs the body once the collectives of every earlier ticket are over.
        Every ticket must be turned exactly once (a failed save turns its
        reservation's with an empty body)."""
        with self._cv:
            self._cv.wait_for(lambda: self._done == ticket)
        try:
            yield
        finally:
            with self._cv:
                self._done += 1
                self._cv.notify_all()


_collectives = _Collectives()
