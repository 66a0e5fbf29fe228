"""The built-in APF configurations, shipped inside the package as ``apf_gunicorn.builtin_config``.

Use :func:`apf_gunicorn.flowcontrol.loader.builtin_path` to locate them; this file only makes the
directory importable as package data.
"""
