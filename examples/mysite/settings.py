"""Settings of the example project: no database, no templates, just views."""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]
ROOT_URLCONF = "examples.mysite.urls"
INSTALLED_APPS: list[str] = []
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
DATABASES: dict = {}
USE_TZ = True
# Django sets the process's TZ to TIME_ZONE (its default is America/Chicago): UTC keeps the
# workers' log timestamps in the master's zone on a server that runs in UTC.
TIME_ZONE = "UTC"
