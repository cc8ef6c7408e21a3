"""Progress bars for the CLI's long work (`ebbtide demo`, `rok`, `bench io`,
`ckpt inspect`): drawn on stderr only when stderr is a terminal and the
command does not print JSON, so pipes, logs and `--json` output stay as they
were. tqdm draws the bar when it is installed (transformers brings it);
otherwise a plain one-line counter does.

Example::

    with progress(total=6, desc="demo", shown=wanted(args.json)) as bar:
        log = bar.log(sys.stdout)
        for i in range(6):
            bar.describe(f"step {i + 1}/6")
            ...
            bar.update()
"""
import shutil
import sys
import threading
import time


def wanted(json_output=False, stream=None) -> bool:
    """True when a progress bar should be drawn: not for JSON output, and only
    when `stream` (default sys.stderr) is a terminal."""
    if json_output:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A bar on stderr (see progress()); every method is a no-op when it is
    not shown, except log()/write(), which then print plainly."""

    def __init__(self, total, desc, shown, unit, unit_scale, delay, tick_s):
        self.shown = shown
        self.prefix = ""  # put before every describe() text (an outer loop's position)
        self._bar = None
        self._plain = None
        self._stop = threading.Event()
        self._ticker = None
        self._delay = delay
        if not shown:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._plain = _PlainBar(total, desc, unit, unit_scale, delay)
        else:
            # A terminal that reports a size of 0 x 0 (a pty nobody sized) gets
            # no bar from tqdm: shutil falls back to COLUMNS and LINES, then 80 x 24.
            columns, lines = shutil.get_terminal_size()
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                             unit_divisor=1024 if unit_scale else 1000, delay=delay, file=sys.stderr,
                             ncols=columns, nrows=lines, leave=False)
        if tick_s:
            # One long call (a benchmark, a shard's checksums) updates nothing
            # while it runs: redraw so that the elapsed time moves.
            self._ticker = threading.Thread(target=self._tick, args=(tick_s,), daemon=True,
                                            name="ebbtide-progress")
            self._ticker.start()

    def _tick(self, interval_s):
        t0 = time.monotonic()
        while not self._stop.wait(interval_s):
            if time.monotonic() - t0 >= self._delay:  # tqdm's refresh() would draw before its delay
                self._draw()

    def _draw(self):
        if self._bar is not None:
            self._bar.refresh()
        elif self._plain is not None:
            self._plain.draw()

    def update(self, n=1):
        if self._bar is not None:
            self._bar.update(n)
        elif self._plain is not None:
            self._plain.n += n
            self._plain.draw()

    def set(self, done, total=None):
        """Sets the absolute progress (and the total, when it changes)."""
        if total is not None:
            self.set_total(total)
        self.update(done - self.n)

    def set_total(self, total):
        if self._bar is not None and self._bar.total != total:
            self._bar.total = total
            self._bar.refresh()
        elif self._plain is not None:
            self._plain.total = total

    @property
    def n(self):
        if self._bar is not None:
            return self._bar.n
        return self._plain.n if self._plain is not None else 0

    def describe(self, text):
        """Replaces the text in front of the bar (after `prefix`)."""
        text = self.prefix + text
        if self._bar is not None:
            self._bar.set_description_str(text)
        elif self._plain is not None:
            self._plain.desc = text
            self._plain.draw()

    def write(self, text, file=None):
        """Prints a line above the bar (plainly when no bar is shown)."""
        file = sys.stdout if file is None else file
        if self._bar is not None:
            self._bar.write(text, file=file)
        elif self._plain is not None:
            self._plain.clear()
            print(text, file=file, flush=True)
            self._plain.draw()
        else:
            print(text, file=file)

    def log(self, file=None):
        """A log function printing to `file` (default stdout) above the bar."""
        return lambda text: self.write(text, file=file)

    def close(self):
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain is not None:
            self._plain.clear()
            self._plain = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _PlainBar:
    """`desc: n/total unit [elapsed]` on one line of stderr, redrawn in place."""

    def __init__(self, total, desc, unit, unit_scale, delay):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = 0
        self._t0 = time.monotonic()
        self._delay = delay
        self._width = 0
        self._lock = threading.Lock()

    def _count(self, v):
        if not self.unit_scale:
            return str(v)
        from ebbtide import _core
        return _core.format_bytes(float(v))

    def draw(self):
        elapsed = time.monotonic() - self._t0
        if elapsed < self._delay:
            return
        total = f"/{self._count(self.total)}" if self.total else ""
        line = f"{self.desc}: {self._count(self.n)}{total} {self.unit} [{elapsed:.0f} s]"
        with self._lock:
            sys.stderr.write("\r" + line.ljust(self._width))
            sys.stderr.flush()
            self._width = len(line)

    def clear(self):
        with self._lock:
            if self._width:
                sys.stderr.write("\r" + " " * self._width + "\r")
                sys.stderr.flush()
                self._width = 0


def progress(total=None, desc="", *, shown, unit="step", unit_scale=False, delay=0.0, tick_s=None):
    """A progress bar on stderr, or a silent stand-in when `shown` is false.

    Args:
        total: units of work (None: unknown; the bar counts without a total).
        desc: the text in front of the bar (describe() changes it).
        shown: draw it (normally wanted(args.json)).
        unit: what a unit is ("step", "B", ...).
        unit_scale: show counts as byte sizes (for unit "B").
        delay: seconds before the bar first appears (short work shows none).
        tick_s: redraw every this many seconds (for long calls that do not
            report progress).

    Returns:
        A Progress, also a context manager that closes it.
    """
    return Progress(total, desc, shown, unit, unit_scale, delay, tick_s)
