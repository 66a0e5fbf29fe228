"""The Django app of the in-process tests (tests/test_django.py). The settings module is set
only while Django reads it, so servers the same test session starts later do not inherit it."""

import os

from django.core.wsgi import get_wsgi_application

_saved = os.environ.get("DJANGO_SETTINGS_MODULE")
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.apps.django_settings"
try:
    application = get_wsgi_application()  # django.setup() reads the settings now
finally:
    if _saved is None:
        del os.environ["DJANGO_SETTINGS_MODULE"]
    else:
        os.environ["DJANGO_SETTINGS_MODULE"] = _saved
