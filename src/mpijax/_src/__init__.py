from .jax_version import warn_if_untested

# Before anything touches JAX's private API, which an untested JAX may lack.
warn_if_untested()
