"""The Redis side of streamrl: key names, Lua scripts, consumer-group helpers, trimming."""

from streamrl.bus.keys import Keys

__all__ = ["Keys"]
