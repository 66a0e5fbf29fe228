"""Django settings for the in-process tests of tests/test_django.py: the example project's,
with a URLconf that adds views decorated the wrong way and ``i18n_patterns`` in English and
French."""

from examples.mysite.settings import *  # noqa: F403

ROOT_URLCONF = "tests.apps.django_urls"
LANGUAGE_CODE = "en"
LANGUAGES = [("en", "English"), ("fr", "French")]
