"""/docs and /redoc work on an air-gapped cluster: every asset they load comes from the server."""

import asyncio
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import pytest

from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

BASE = "http://packscore.test"


class _Links(HTMLParser):
    """Every URL the page makes the browser fetch (src, href) and every inline script."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_nothing_from_another_host(page):
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            html = await client.get(page)
            links = _Links()
            links.feed(html.text)
            assets = {url: await client.get(urljoin(BASE + page, url)) for url in links.urls}
            return html, links, assets

    html, links, assets = asyncio.run(main())
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert links.urls, "the page loads no asset at all: not Swagger UI / ReDoc"
    foreign = [url for url in links.urls if urlsplit(urljoin(BASE + page, url)).netloc != urlsplit(BASE).netloc]
    assert not foreign, f"{page} loads assets from another host: {foreign}"
    for url, response in assets.items():
        assert response.status_code == 200 and len(response.content) > 100, (url, response.status_code)
    # The script that starts Swagger UI fetches the schema from this server and no validator badge.
    script = "\n".join(links.scripts)
    assert "http://" not in script and "https://" not in script, script
