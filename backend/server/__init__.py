"""The bundled OpenAI-compatible model server over ``backend.engine``."""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
