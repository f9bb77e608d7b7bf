// specexport.hpp: a header-only C++17 wrapper of the C ABI in specexport.h.
//
//   specexport::Engine engine("smollm2-135m-eagle3-onnxruntime-int8");          // RAII: closed by the destructor
//   specexport::GenerateOptions request;
//   request.prompt = "Write a haiku about the sea.";
//   auto stats = engine.generate(request, [](const specexport::Chunk& chunk) {  // void, or bool: false stops
//       std::cout << chunk.text << std::flush;
//   });
//
// Every failure throws specexport::Error, carrying the C status and the one-line message; an exception thrown by
// the lambda stops the generation and comes back as an Error with status SPECEXPORT_E_CALLBACK and its what().
// Thread safety is the C ABI's: one Engine may be shared by many threads (generate and cancel are const).
#ifndef SPECEXPORT_HPP
#define SPECEXPORT_HPP

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "specexport.h"

namespace specexport {

class Error : public std::runtime_error {
public:
    Error(specexport_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
    specexport_status status() const noexcept { return status_; }
    const char* status_name() const noexcept { return specexport_status_name(status_); }

private:
    specexport_status status_;
};

namespace detail {
inline void check(specexport_status status) {
    if (status != SPECEXPORT_OK) throw Error(status, specexport_last_error());
}
}  // namespace detail

inline std::string version() { return specexport_version(); }

struct OpenOptions {
    int threads = 0;           // per model call; 0 = every core
    std::string device = "auto";
    std::string settings;      // the method's run-time settings as a JSON object, e.g. {"draft_length": 4}
    bool verify = true;        // sha256 of every file at open
    int max_batch = 0;         // generations batched in one model call; 0 = 8, -1 = each alone
};

struct GenerateOptions {
    std::string prompt;                 // text (chat template applied unless raw) ...
    std::vector<int32_t> prompt_ids;    // ... or token ids, used when not empty
    bool raw = false;
    uint32_t max_new_tokens = 128;
    double temperature = 0.0;           // 0 = greedy
    int top_k = 0;
    double top_p = 1.0;
    int64_t seed = -1;                  // -1 = a fresh random stream
    std::vector<std::string> stop;
    std::vector<int32_t> stop_ids;
    uint64_t request_id = 0;            // for Engine::cancel; 0 = not cancellable
    double min_p = 0.0;                 // 0 = off
    double repetition_penalty = 1.0;    // 1 = off
    double frequency_penalty = 0.0;
    double presence_penalty = 0.0;
    uint32_t min_tokens = 0;
    std::string constraint_kind;        // structured output: "json_schema", "regex", "grammar", "choice"; "" = none
    std::string constraint;             // its text
};

// What the lambda receives: new token ids or new text (one of them empty), valid during the call only.
struct Chunk {
    const int32_t* ids;
    size_t n_ids;
    std::string_view text;
    const int32_t* begin() const noexcept { return ids; }
    const int32_t* end() const noexcept { return ids + n_ids; }
};

using Stats = specexport_stats;

struct Result {
    std::vector<int32_t> tokens;
    std::string text;
    Stats stats;
};

class Engine {
public:
    explicit Engine(const std::string& bundle, const OpenOptions& options = {}) {
        specexport_open_options o;
        specexport_open_options_init(&o);
        o.threads = options.threads;
        o.device = options.device.c_str();
        o.settings = options.settings.empty() ? nullptr : options.settings.c_str();
        o.verify = options.verify ? 1 : 0;
        o.max_batch = options.max_batch;
        detail::check(specexport_open(bundle.c_str(), &o, &handle_));
    }
    ~Engine() { specexport_close(handle_); }  // waits for this engine's running generations (cancelled)
    Engine(Engine&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    Engine& operator=(Engine&& other) noexcept {
        if (this != &other) {
            specexport_close(handle_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Close now (errors thrown); the destructor then does nothing.
    void close() { detail::check(specexport_close(std::exchange(handle_, nullptr))); }

    // Stream a generation to `on_chunk(const Chunk&)`, which returns void, or bool (false = stop: the generation
    // ends with stop reason SPECEXPORT_STOP_CANCELLED). Returns the stats.
    template <class F>
    Stats generate(const GenerateOptions& options, F&& on_chunk) const {
        struct Context {
            std::remove_reference_t<F>* f;
            std::exception_ptr error;
        } context{&on_chunk, nullptr};
        specexport_stream_fn trampoline = [](void* user, const int32_t* ids, size_t n_ids, const char* text,
                                             size_t text_len) -> int {
            auto* c = static_cast<Context*>(user);
            try {
                Chunk chunk{ids, n_ids, std::string_view(text, text_len)};
                if constexpr (std::is_void_v<std::invoke_result_t<decltype(*c->f), const Chunk&>>) {
                    (*c->f)(chunk);
                    return SPECEXPORT_STREAM_CONTINUE;
                } else {
                    return (*c->f)(chunk) ? SPECEXPORT_STREAM_CONTINUE : SPECEXPORT_STREAM_STOP;
                }
            } catch (...) {  // no exception crosses the C ABI: keep it, rethrow as an Error below
                c->error = std::current_exception();
                return -1;
            }
        };
        return run(options, trampoline, &context, context.error);
    }

    // The whole generation at once (no streaming).
    Result generate(const GenerateOptions& options) const {
        Result result;
        result.stats = generate(options, [&result](const Chunk& chunk) {
            result.tokens.insert(result.tokens.end(), chunk.begin(), chunk.end());
            result.text.append(chunk.text);
        });
        return result;
    }

    // Stop the running generations with this request id before their next step; false if none runs.
    bool cancel(uint64_t request_id) const {
        specexport_status status = specexport_cancel(handle_, request_id);
        if (status == SPECEXPORT_E_NOT_FOUND) return false;
        detail::check(status);
        return true;
    }

    specexport_engine* handle() const noexcept { return handle_; }

private:
    Stats run(const GenerateOptions& options, specexport_stream_fn stream, void* user,
              const std::exception_ptr& error) const {
        std::vector<const char*> stop;
        for (const std::string& s : options.stop) stop.push_back(s.c_str());
        specexport_generate_options o;
        specexport_generate_options_init(&o);
        if (options.prompt_ids.empty()) {
            o.prompt = options.prompt.c_str();
        } else {
            o.prompt_ids = options.prompt_ids.data();
            o.n_prompt_ids = options.prompt_ids.size();
        }
        o.raw = options.raw ? 1 : 0;
        o.max_new_tokens = options.max_new_tokens;
        o.temperature = options.temperature;
        o.top_k = options.top_k;
        o.top_p = options.top_p;
        o.seed = options.seed;
        o.stop = stop.data();
        o.n_stop = stop.size();
        o.stop_ids = options.stop_ids.data();
        o.n_stop_ids = options.stop_ids.size();
        o.request_id = options.request_id;
        o.min_p = options.min_p;
        o.repetition_penalty = options.repetition_penalty;
        o.frequency_penalty = options.frequency_penalty;
        o.presence_penalty = options.presence_penalty;
        o.min_tokens = options.min_tokens;
        if (!options.constraint_kind.empty()) {
            o.constraint_kind = options.constraint_kind.c_str();
            o.constraint = options.constraint.c_str();
        }
        Stats stats{};
        stats.size = sizeof stats;
        specexport_status status = specexport_generate(handle_, &o, stream, user, &stats);
        if (error) {
            std::string what = "unknown exception";
            try {
                std::rethrow_exception(error);
            } catch (const std::exception& e) {
                what = e.what();
            } catch (...) {
            }
            throw Error(SPECEXPORT_E_CALLBACK, "the stream callback threw: " + what);
        }
        detail::check(status);
        return stats;
    }

    specexport_engine* handle_ = nullptr;
};

}  // namespace specexport

#endif  // SPECEXPORT_HPP
