"""BYOC plugins that generate INT8 code from profiles (not built yet: see the open issues)."""
