"""WSGI entry point: ``gunicorn -c python:apf_gunicorn.conf examples.mysite.wsgi:application``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.mysite.settings")

application = get_wsgi_application()
