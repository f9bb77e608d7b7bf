// wrapper_check: the C++ wrapper (specexport.hpp) for tests/test_embed.py, one JSON object per line on stdout.
//
//   wrapper_check BUNDLE
#include <cstdio>
#include <stdexcept>
#include <string>

#include "specexport.hpp"

namespace {

void line(const char* name, const std::string& json) { std::printf("{\"case\": \"%s\", %s}\n", name, json.c_str()); }

std::string error_json(const specexport::Error& e) {
    std::string message = e.what();
    for (char& c : message)
        if (c == '"' || c == '\\') c = '\'';
    return std::string("\"status\": \"") + e.status_name() + "\", \"message\": \"" + message + "\"";
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    try {
        specexport::Engine missing("/nonexistent/bundle");
        line("open_missing", "\"status\": \"SPECEXPORT_OK\"");
    } catch (const specexport::Error& e) {
        line("open_missing", error_json(e));
    }
    specexport::OpenOptions options;
    options.threads = 1;
    specexport::Engine engine(argv[1], options);
    specexport::GenerateOptions request;
    request.prompt = "the cat sat";
    request.raw = true;
    request.max_new_tokens = 8;

    specexport::Result result = engine.generate(request);  // collected
    std::string ids;
    for (int32_t id : result.tokens) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    line("collected", "\"tokens\": [" + ids + "], \"new_tokens\": " + std::to_string(result.stats.new_tokens));

    int chunks = 0;  // a lambda returning bool: false stops (room for the steps the engine may make before it runs)
    request.max_new_tokens = 200;
    specexport::Stats stats = engine.generate(request, [&chunks](const specexport::Chunk&) { return ++chunks < 2; });
    request.max_new_tokens = 8;
    line("lambda_stop", "\"chunks\": " + std::to_string(chunks) + ", \"stop_reason\": " + std::to_string(stats.stop_reason));

    try {  // a lambda that throws
        engine.generate(request, [](const specexport::Chunk&) { throw std::runtime_error("no room left"); });
        line("lambda_throws", "\"status\": \"SPECEXPORT_OK\"");
    } catch (const specexport::Error& e) {
        line("lambda_throws", error_json(e));
    }
    try {
        request.top_p = 2;
        engine.generate(request);
    } catch (const specexport::Error& e) {
        line("bad_top_p", error_json(e));
    }
    request.top_p = 1;
    specexport::Engine moved = std::move(engine);  // RAII: the moved-from engine owns nothing
    line("moved", "\"new_tokens\": " + std::to_string(moved.generate(request).stats.new_tokens));
    try {
        engine.generate(request);
    } catch (const specexport::Error& e) {
        line("moved_from", error_json(e));
    }
    return 0;
}
