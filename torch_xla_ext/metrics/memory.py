"""Peak resident memory of this process, restartable so that a step's own peak
can be read (Linux; elsewhere the process's lifetime peak)."""
from __future__ import annotations

import resource


def reset_peak_rss() -> bool:
    """Restarts the count of `peak_rss_bytes` from the current RSS (Linux);
    False where that is not possible, and the peak stays the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since it started or since
    `reset_peak_rss`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB
