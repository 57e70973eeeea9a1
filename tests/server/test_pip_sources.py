"""`make setup` installs with uv from the sources pip is configured with (server.pip_sources)."""
from eagle_serve.server.pip_sources import uv_options

LISTED = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
:env:.index-url='https://mirror.example/simple'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels\\n/srv/wheels'
global.index-url='https://other.example/simple'
user.timeout='60'
"""


def test_pips_find_links_and_indexes_become_uvs_options_each_once_with_the_environments_index():
    assert uv_options(LISTED) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels", "--find-links", "/srv/wheels"]


def test_without_configured_sources_uv_keeps_its_defaults():
    assert uv_options("") == []
    assert uv_options("global.timeout='60'\n") == []
    assert uv_options("user.index-url='https://u.example/simple'\nglobal.index-url='https://g.example/simple'") == [
        "--index-url", "https://u.example/simple"]
