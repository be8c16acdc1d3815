"""The prune config: upstream's dict form, its presets, and its validation.

A config names, per domain, one method and its ``kwargs``; the domains it leaves out are not
pruned. ``config=None`` prunes all three domains at upstream's defaults. Every key is checked
before any work: an unknown key (top level, method or kwarg) is refused with the accepted ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

# domain -> method -> (kwargs it reads, whether it rewrites weights). A method that rewrites
# weights cannot be tried by masking: the search tries it on a copy.
METHODS = {
    "dense": {
        "low_variance": (frozenset({"prune_ratio"}), False),
        "reconstruct": (frozenset({"prune_ratio", "ridge", "recovery"}), True),
    },
    "cnn": {
        "variance_channel": (frozenset({"prune_ratio"}), False),
        "reconstruct": (frozenset({"prune_ratio", "ridge", "recovery"}), True),
    },
    "moe": {
        "activation_count": (frozenset({"prune_ratio"}), False),
        "mass_variance": (frozenset({"prune_ratio", "boundary", "variance_score"}), False),
        "output_merge": (frozenset({"keep_ratio", "selector"}), True),
    },
}
TOP_LEVEL_KEYS = ("methods", "skip_layers", "allocation", "missing_data_policy")
ALLOCATION_KEYS = ("strategy", "ref_ratio", "min_ratio", "max_ratio", "guard")
CHOICES = {
    "recovery": ("ls", "bias", "none"),
    "variance_score": ("cond", "peak", "cvxpeak"),
    "selector": ("calib_nll", "none"),
    "missing_data_policy": ("warn_skip", "raise"),
    "strategy": ("uniform", "sensitivity"),
    "guard": ("calib_nll", "none"),
}
DEFAULT_METHODS = {
    "cnn": {"name": "variance_channel", "kwargs": {"prune_ratio": 0.30}},
    "dense": {"name": "low_variance", "kwargs": {"prune_ratio": 0.50}},
    "moe": {"name": "mass_variance", "kwargs": {"prune_ratio": 0.50, "boundary": 10}},
}
# A domain's processing order: experts before FFN widths before conv channels (independent
# structures; a fixed order keeps reports and logs stable).
DOMAIN_ORDER = ("moe", "dense", "cnn")


@dataclass
class MethodSpec:
    """One domain's method: its name, kwargs, and an optional menu of (label, spec) candidates."""

    domain: str
    name: str
    kwargs: dict = field(default_factory=dict)
    menu: tuple = ()

    @property
    def rewrites_weights(self) -> bool:
        return METHODS[self.domain][self.name][1]

    @property
    def ratio(self) -> float:
        """The share of the domain's channels (or experts) this method removes."""
        if "keep_ratio" in self.kwargs:
            return 1.0 - float(self.kwargs["keep_ratio"])
        return float(self.kwargs.get("prune_ratio", DEFAULT_METHODS[self.domain]["kwargs"]["prune_ratio"]))

    def with_ratio(self, ratio: float) -> MethodSpec:
        kwargs = dict(self.kwargs)
        if self.name == "output_merge":
            kwargs["keep_ratio"] = 1.0 - ratio
        else:
            kwargs["prune_ratio"] = ratio
        return MethodSpec(self.domain, self.name, kwargs, self.menu)


@dataclass
class PruneConfig:
    """A validated config: the methods in play, the names left alone, the allocation."""

    methods: dict[str, MethodSpec]
    skip_layers: list[str] = field(default_factory=list)
    allocation: dict | None = None
    missing_data_policy: str = "warn_skip"

    def in_play(self) -> list[MethodSpec]:
        """The methods that cut something, in processing order."""
        return [self.methods[d] for d in DOMAIN_ORDER if d in self.methods and self.methods[d].ratio > 0]

    def with_ratio(self, ratio: float) -> PruneConfig:
        """Every method in play at ``ratio`` (the search's one knob)."""
        out = copy.copy(self)
        out.methods = {d: (s.with_ratio(ratio) if s.ratio > 0 else s) for d, s in self.methods.items()}
        return out

    @property
    def menu_domain(self) -> str | None:
        return next((d for d, s in self.methods.items() if s.menu), None)


def _choice(where: str, key: str, value) -> None:
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(f"{where}: {key}={value!r} is not one of {list(CHOICES[key])}")


def _ratio(where: str, key: str, value, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {key} must be a number, got {type(value).__name__}")
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value < 1.0):
        raise ValueError(f"{where}: {key}={value} is outside {'(0, 1]' if low_open else '[0, 1)'}")


def _method(domain: str, spec, where: str) -> MethodSpec:
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise TypeError(f"{where} must be a method name or a dict with 'name' and 'kwargs', got {type(spec).__name__}")
    extra = set(spec) - {"name", "kwargs", "menu"}
    if extra:
        raise ValueError(f"{where}: unknown key(s) {sorted(extra)}; accepted: ['kwargs', 'menu', 'name']")
    name = spec.get("name")
    if name not in METHODS[domain]:
        raise ValueError(f"{where}: unknown method {name!r} for domain {domain!r}; accepted: {sorted(METHODS[domain])}")
    kwargs = dict(spec.get("kwargs") or {})
    accepted = METHODS[domain][name][0]
    unknown = set(kwargs) - accepted
    if unknown:
        raise ValueError(f"{where}.kwargs: unknown key(s) {sorted(unknown)} for method {name!r}; "
                         f"accepted: {sorted(accepted)}")
    for key, value in kwargs.items():
        if key == "prune_ratio":
            _ratio(where, key, value)
        elif key == "keep_ratio":
            _ratio(where, key, value, low_open=True)
        elif key == "ridge" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{where}: ridge must be a number >= 0, got {value!r}")
        elif key == "boundary" and not (value == "auto" or isinstance(value, (int, list, tuple))):
            raise ValueError(f"{where}: boundary must be an int, 'auto' or a list of layer indices, got {value!r}")
        _choice(where, key, value)
    menu = []
    for i, item in enumerate(spec.get("menu") or ()):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{where}.menu[{i}] must be a (label, method spec) pair")
        base = {"name": item[1].get("name", name), "kwargs": {**kwargs, **(item[1].get("kwargs") or {})}}
        menu.append((item[0], _method(domain, base, f"{where}.menu[{i}]")))
    return MethodSpec(domain, name, kwargs, tuple(menu))


def parse_config(config) -> PruneConfig:
    """A dict (upstream's form), a ``PruneConfig`` or None, checked and normalised."""
    if isinstance(config, PruneConfig):
        return copy.deepcopy(config)
    if config is None:
        config = {"methods": DEFAULT_METHODS}
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    unknown = set(config) - set(TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"config: unknown key(s) {sorted(unknown)}; accepted: {sorted(TOP_LEVEL_KEYS)}")
    methods = config.get("methods")
    if not isinstance(methods, Mapping) or not methods:
        raise ValueError("config['methods'] must be a non-empty dict of domain -> method "
                         f"(domains: {sorted(METHODS)})")
    bad = set(methods) - set(METHODS)
    if bad:
        raise ValueError(f"config['methods']: unknown domain(s) {sorted(bad)}; accepted: {sorted(METHODS)}")
    parsed = {d: _method(d, s, f"config['methods'][{d!r}]") for d, s in methods.items()}
    skip = config.get("skip_layers") or []
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError("config['skip_layers'] must be a list of name fragments (str)")
    alloc = config.get("allocation")
    if alloc is not None:
        if not isinstance(alloc, Mapping):
            raise TypeError("config['allocation'] must be a dict")
        unknown = set(alloc) - set(ALLOCATION_KEYS)
        if unknown:
            raise ValueError(f"config['allocation']: unknown key(s) {sorted(unknown)}; accepted: {sorted(ALLOCATION_KEYS)}")
        for key, value in alloc.items():
            _choice("config['allocation']", key, value)
            if key.endswith("_ratio"):
                _ratio("config['allocation']", key, value)
        alloc = {"strategy": "uniform", "ref_ratio": 0.5, "min_ratio": 0.05, "max_ratio": 0.9,
                 "guard": "calib_nll", **alloc}
    policy = config.get("missing_data_policy", "warn_skip")
    _choice("config", "missing_data_policy", policy)
    return PruneConfig(parsed, list(skip), dict(alloc) if alloc else None, policy)


def is_skipped(unit, skip_layers) -> bool:
    """Whether ``skip_layers`` names the unit (a fragment of its name or of a member's path)."""
    names = (unit.name, *unit.members)
    return any(frag in n for frag in skip_layers for n in names)
