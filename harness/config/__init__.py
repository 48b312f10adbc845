"""The configuration room: composition and sweeps (compose), typed schemas (schema),
input checks (checks), who the ranks are (ranks), what engine=horovod needs (engine)
and the cache of compositions and model facts (cache). Nothing here starts a process.

The composition's public functions are re-exported here, so commands say
`config.load(...)`."""

from harness.config.compose import (
    choices,
    compose_raw,
    expand,
    from_json,
    load,
    load_all,
    sweep,
    to_json,
    validate,
)
from harness.config.schema import (
    CONF_DIR,
    ConfigError,
    first_line,
    is_real_network,
    resolve_backend,
    resolve_device,
)

__all__ = ["CONF_DIR", "ConfigError", "choices", "compose_raw", "expand", "first_line",
           "from_json", "is_real_network", "load", "load_all", "resolve_backend",
           "resolve_device", "sweep", "to_json", "validate"]
