"""``sg.debugging``: TF's ``tf.debugging`` names that apply here (the device placement log)."""

from stratagem.distribute import (
    get_log_device_placement,
    set_log_device_placement,
)

__all__ = ["get_log_device_placement", "set_log_device_placement"]
