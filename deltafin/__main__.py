"""`python -m deltafin [overrides]`: compose the config, set up logging, build the app, serve it."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from deltafin.config import CONF_DIR, ConfigError, validate_config
from deltafin.engine.loader import ModelLoadError, check_expert_pool, resolve_model_path
from deltafin.families import check_family
from deltafin.rules import build_pipeline


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        config = validate_config(raw)
        # Fail fast, before serving: a bad rule or family variant is a one-line config error.
        build_pipeline(config.compat.rules, config.model.family)
        check_family(config.model.family, config.model.variant)
        resolve_model_path(config.model.path)
        check_expert_pool(config.model, config.placement, max_batch=config.engine.max_batch)
    except (ConfigError, ModelLoadError) as exc:
        print(f"deltafin: config error: {exc}", file=sys.stderr)
        sys.exit(2)

    from deltafin.app import build_app
    from deltafin.app.server import serve
    from deltafin.logging import configure_logging

    configure_logging(config.server.log_level)
    serve(build_app(config), config)

if __name__ == "__main__":
    main()
