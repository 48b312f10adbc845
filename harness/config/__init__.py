"""The configuration room: composition and sweeps (compose), the overrides as typed (overrides),
typed schemas (schema), the
rules every configuration keeps (rules), input checks (checks), input tables (tables),
every command's --help (usage), read-only configurations
of simulated sweeps (frozen), who the ranks are (ranks), what engine=horovod needs
(engine) and the cache of compositions and model facts (cache). Nothing here starts a
process, and nothing here imports torch.

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
)
from harness.config.frozen import Config, Frozen, thaw, to_json
from harness.config.rules import validate
from harness.config.schema import (
    CONF_DIR,
    ConfigError,
    first_line,
    is_real_network,
    resolve_backend,
    resolve_device,
)

__all__ = ["CONF_DIR", "Config", "ConfigError", "Frozen", "choices", "compose_raw", "expand",
           "first_line", "from_json", "is_real_network", "load", "load_all", "resolve_backend",
           "resolve_device", "sweep", "thaw", "to_json", "validate"]
