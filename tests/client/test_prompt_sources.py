import asyncio

from headroom.client.http import OpenAIClient, normalize_base_url
from headroom.client.prompts import build_prompt_factory

from tests.client.client_stub_server import StubConfig, StubServer


def factory_for(config: StubConfig, **options):
    async def build():
        with StubServer(config) as url:
            async with OpenAIClient(url) as client:
                await client.resolve_model()
                return await build_prompt_factory(client, **options)

    return asyncio.run(build())


def test_server_tokenize_is_preferred_and_id_range_is_the_fallback():
    from_server = factory_for(StubConfig())
    assert from_server.source.startswith("server /tokenize") and min(from_server.vocabulary) >= 1000
    fallback = factory_for(StubConfig(faults={"no_tokenize"}))
    assert fallback.source == "id range 32..126"
    explicit = factory_for(StubConfig(), id_range=(40, 90))
    assert explicit.source == "id range 40..89"


def test_base_url_forms():
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("https://h") == "https://h"
