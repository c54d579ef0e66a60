"""The models one process serves (the main one and `models.NAME` entries), each loaded or failed on its own, and
which one a request's `model` chooses."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from deltafin.app.services import Services
from deltafin.config import DeltafinConfig
from deltafin.config.models import is_pattern, name_matches
from deltafin.errors import EngineUnavailableError, ModelNotFoundError, quoted_name


class ServedModel:
    """One model: its config from start-up, then its services once loaded, or why loading failed."""

    def __init__(self, config: DeltafinConfig) -> None:
        self.config = config
        self.name: str = config.model.name
        self.names: tuple[str, ...] = (config.model.name, *config.model.aliases)
        self.services: Services | None = None
        self.error: str | None = None

    @property
    def status(self) -> str:
        return "ok" if self.services is not None else "failed" if self.error else "loading"

    def require(self, several: bool = False) -> Services:
        """The services, or the 503 that says why there are none yet (naming the model when there are several)."""
        if self.services is None:
            which = f"the model `{self.name}`" if several else "the model"
            if self.error:
                raise EngineUnavailableError(
                    f"Service unavailable: {which} failed to load: {self.error.rstrip('.')}.", code="model_load_failed"
                )
            raise EngineUnavailableError(
                f"Service unavailable: {which} is still loading.", headers={"Retry-After": "5"}
            )
        return self.services


class ServedModels:
    """The served models, the main one first. A request without `model` goes to the main one; a request naming
    a model (or an alias; failing those, the first model with an alias pattern it matches) goes to it; with several models an unknown name is a 404 listing them. (With one
    model, the served model's own check answers an unknown name, as it always has.)"""

    def __init__(self, configs: Sequence[DeltafinConfig]) -> None:
        self.models = [ServedModel(config) for config in configs]
        self.main = self.models[0]
        self._by_name = {name: model for model in reversed(self.models) for name in model.names if not is_pattern(name)}
        #: aliases that are patterns of names (`claude-*`), asked in model order after every exact name
        self._patterns = [(alias, model) for model in self.models for alias in model.names if is_pattern(alias)]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    def require(self, name: str | None = None) -> Services:
        """The services a request naming `name` (None: no `model` field) is served by."""
        if name is None or not self.several:
            return self.main.require(several=self.several)
        model = self._by_name.get(name)
        if model is None:
            model = next((each for alias, each in self._patterns if name_matches(alias, name)), None)
        if model is None:
            served = ", ".join(f"`{each.name}`" for each in self.models)
            raise ModelNotFoundError(
                f"The model `{quoted_name(name)}` does not exist. This server serves {served}.", param="model"
            )
        return model.require(several=True)

    def any(self) -> Services:
        """Some loaded model's services (for what is the process's, not a model's: the response store), else
        the main model's 503."""
        return next(iter(self.loaded()), None) or self.main.require(several=self.several)

    def loaded(self) -> list[Services]:
        return [model.services for model in self.models if model.services is not None]
