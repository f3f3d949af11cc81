"""Link rates and sizes in tc's units, converted to bytes per second / bytes."""

from __future__ import annotations

import re

__all__ = ["format_rate", "parse_rate", "parse_size"]

# tc(8): "bit" / bare number = bits per second, "bps" = bytes per second; plus the common
# "GB/s"-style spelling (decimal bytes per second) for people who think in bytes.
_RATE_UNITS: dict[str, float] = {
    "": 1 / 8, "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
}
_SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
    "kbit": 128, "mbit": 128 * 1024, "gbit": 128 * 1024**2,
}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z/]*)\s*$")


def parse_rate(rate: str | float | int) -> float:
    """Bytes per second from ``"1gbit"``, ``"500mbit"``, ``"125mbps"``, ``"1.5GB/s"`` (tc units:
    ``bit`` = bits/s, ``bps`` = bytes/s) or a number (bytes per second)."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        m = _NUM.match(str(rate))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _RATE_UNITS:
            raise ValueError(
                f"cannot read rate {rate!r}: use tc units such as '1gbit', '500mbit', '125mbps' "
                "(bytes/s), '1.5GB/s', or a number of bytes per second"
            )
        value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return value


def parse_size(size: str | int) -> int:
    """Bytes from ``"512kb"``, ``"4mb"`` (tc units: ``kb`` = KiB) or an integer."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    m = _NUM.match(str(size))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {size!r}: use e.g. '512kb', '4mb' or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def format_rate(bytes_per_s: float) -> str:
    """``125e6`` -> ``'125.0 MB/s (1.00 Gbit/s)'``."""
    bits = bytes_per_s * 8
    if bytes_per_s >= 1e9:
        b = f"{bytes_per_s / 1e9:.2f} GB/s"
    else:
        b = f"{bytes_per_s / 1e6:.1f} MB/s"
    g = f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"
    return f"{b} ({g})"
