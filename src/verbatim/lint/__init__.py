"""Checks of recorded runs (`verbatim lint trace`): every rollout token-exact, every request reusing
what the cache could hold, and (opt-in) every group prefilling its shared prompt once."""
