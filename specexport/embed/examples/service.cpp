// service.cpp: an example service over libspecexport, to copy. It loads a bundle once and answers requests
// concurrently: newline-delimited JSON on stdin, responses on stdout.
//
//   specexport-service BUNDLE [--workers 4] [--threads N] [--max-batch 8] [--settings JSON] < requests.jsonl
//
// A request per line (an id of any JSON type; "prompt_ids": [1, 2, 3] instead of "prompt"):
//   {"id": 1, "prompt": "Hello", "max_new_tokens": 64, "temperature": 0.7, "top_k": 40, "top_p": 0.9,
//    "seed": 1, "stop": ["\n\n"], "stop_ids": [2], "raw": false, "min_p": 0.05, "repetition_penalty": 1.1,
//    "frequency_penalty": 0, "presence_penalty": 0, "min_tokens": 0,
//    "constraint_kind": "json_schema", "constraint": "{\"type\": \"object\"}"}
//   {"cancel": 1}                            stops request 1, queued or running
// Responses, one per line, tagged with the request's id:
//   {"id": 1, "tokens": [504, 3300], "text": ""}          chunks, as tokens and text become final
//   {"id": 1, "done": true, "stop_reason": "eos", "prompt_tokens": 5, "new_tokens": 42, ..., "wall_s": 0.81}
//   {"id": 1, "error": "top_p must be in (0, 1], got 0", "status": "SPECEXPORT_E_INVALID_ARGUMENT"}
// Requests run on a pool of --workers threads sharing the one engine, which batches them (up to --max-batch in one
// model call; -1: each alone). At the end of stdin the service finishes
// what it has and exits.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "json.hpp"
#include "specexport.hpp"

namespace {

std::mutex out_mutex;

void emit(const std::string& line) {  // one whole line at a time, whatever thread writes
    std::lock_guard<std::mutex> lock(out_mutex);
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
}

void emit_error(const std::string& id, const std::string& message, const char* status) {
    emit("{\"id\":" + id + ",\"error\":" + json::quote(message) + ",\"status\":" + json::quote(status) + "}");
}

std::string number(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f", x);
    return buf;
}

const char* stop_reason(int reason) {
    static const char* const names[] = {"none", "eos", "stop_string", "length", "context", "cancelled"};
    return reason >= 0 && reason <= 5 ? names[reason] : "unknown";
}

struct Request {
    std::string id;  // as the client wrote it (JSON)
    specexport::GenerateOptions options;
};

// ---- requests ---------------------------------------------------------------------------------------------

double get_number(const json::Value& request, const char* key, double fallback) {
    const json::Value* v = request.get(key);
    if (v == nullptr) return fallback;
    if (v->kind != json::Value::Number) throw std::runtime_error(std::string(key) + " must be a number");
    return v->number;
}

std::vector<int32_t> get_ids(const json::Value& request, const char* key) {
    std::vector<int32_t> ids;
    if (const json::Value* v = request.get(key)) {
        if (v->kind != json::Value::Array) throw std::runtime_error(std::string(key) + " must be a list of token ids");
        for (const json::Value& item : v->items) {
            if (item.kind != json::Value::Number) throw std::runtime_error(std::string(key) + " must hold numbers");
            ids.push_back(static_cast<int32_t>(item.number));
        }
    }
    return ids;
}

specexport::GenerateOptions parse_options(const json::Value& r) {
    specexport::GenerateOptions o;
    if (const json::Value* prompt = r.get("prompt")) {
        if (prompt->kind != json::Value::String) throw std::runtime_error("prompt must be a string");
        o.prompt = prompt->text;
    }
    o.prompt_ids = get_ids(r, "prompt_ids");
    double max_new = get_number(r, "max_new_tokens", 128);
    if (max_new < 0 || max_new > 1e9) throw std::runtime_error("max_new_tokens must be >= 1");
    o.max_new_tokens = static_cast<uint32_t>(max_new);
    o.temperature = get_number(r, "temperature", 0.0);
    o.top_k = static_cast<int>(get_number(r, "top_k", 0));
    o.top_p = get_number(r, "top_p", 1.0);
    o.seed = static_cast<int64_t>(get_number(r, "seed", -1));
    if (const json::Value* stop = r.get("stop")) {
        if (stop->kind != json::Value::Array) throw std::runtime_error("stop must be a list of strings");
        for (const json::Value& s : stop->items) {
            if (s.kind != json::Value::String) throw std::runtime_error("stop must be a list of strings");
            o.stop.push_back(s.text);
        }
    }
    o.stop_ids = get_ids(r, "stop_ids");
    if (const json::Value* raw = r.get("raw")) o.raw = raw->kind == json::Value::Bool && raw->boolean;
    o.min_p = get_number(r, "min_p", 0.0);
    o.repetition_penalty = get_number(r, "repetition_penalty", 1.0);
    o.frequency_penalty = get_number(r, "frequency_penalty", 0.0);
    o.presence_penalty = get_number(r, "presence_penalty", 0.0);
    double min_tokens = get_number(r, "min_tokens", 0);
    if (min_tokens < 0 || min_tokens > 1e9) throw std::runtime_error("min_tokens must be >= 0");
    o.min_tokens = static_cast<uint32_t>(min_tokens);
    for (auto [key, field] : {std::pair{"constraint_kind", &o.constraint_kind}, std::pair{"constraint", &o.constraint}})
        if (const json::Value* v = r.get(key)) {
            if (v->kind != json::Value::String) throw std::runtime_error(std::string(key) + " must be a string");
            *field = v->text;
        }
    return o;
}

// ---- the pool ---------------------------------------------------------------------------------------------

class Service {
public:
    Service(const specexport::Engine& engine, int workers) : engine_(engine) {
        for (int i = 0; i < workers; i++) threads_.emplace_back([this] { work(); });
    }

    void submit(Request request) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (live_.count(request.id)) return emit_error(request.id, "this id is already in flight", "invalid_request");
        request.options.request_id = ++last_request_id_;
        live_[request.id] = request.options.request_id;
        queue_.push_back(std::move(request));
        wake_.notify_one();
    }

    void cancel(const std::string& id) {
        std::unique_lock<std::mutex> lock(mutex_);
        for (auto it = queue_.begin(); it != queue_.end(); ++it)
            if (it->id == id) {  // not started: answer at once
                queue_.erase(it);
                live_.erase(id);
                lock.unlock();
                return emit("{\"id\":" + id + ",\"done\":true,\"stop_reason\":\"cancelled\",\"new_tokens\":0}");
            }
        auto it = live_.find(id);
        if (it != live_.end()) engine_.cancel(it->second);  // running: it stops before its next step
    }

    void finish() {  // serve what is queued, then stop the workers
        {
            std::lock_guard<std::mutex> lock(mutex_);
            closing_ = true;
        }
        wake_.notify_all();
        for (std::thread& t : threads_) t.join();
    }

private:
    void work() {
        for (;;) {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [this] { return closing_ || !queue_.empty(); });
            if (queue_.empty()) return;
            Request request = std::move(queue_.front());
            queue_.pop_front();
            lock.unlock();
            run(request);
            lock.lock();
            live_.erase(request.id);
        }
    }

    void run(const Request& r) {
        auto start = std::chrono::steady_clock::now();
        try {
            specexport::Stats s = engine_.generate(r.options, [&r](const specexport::Chunk& chunk) {
                std::string ids;
                for (int32_t id : chunk) ids += (ids.empty() ? "" : ",") + std::to_string(id);
                emit("{\"id\":" + r.id + ",\"tokens\":[" + ids + "],\"text\":" + json::quote(chunk.text) + "}");
            });
            double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            emit("{\"id\":" + r.id + ",\"done\":true,\"stop_reason\":\"" + stop_reason(s.stop_reason) +
                 "\",\"prompt_tokens\":" + std::to_string(s.prompt_tokens) +
                 ",\"new_tokens\":" + std::to_string(s.new_tokens) + ",\"steps\":" + std::to_string(s.steps) +
                 ",\"ttft_s\":" + number(s.ttft_s) + ",\"seconds\":" + number(s.seconds) +
                 ",\"tokens_per_s\":" + number(s.tokens_per_s) + ",\"tau\":" + number(s.tau) +
                 ",\"wall_s\":" + number(wall) + "}");
        } catch (const specexport::Error& e) {
            emit_error(r.id, e.what(), e.status_name());
        }
    }

    const specexport::Engine& engine_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<Request> queue_;
    std::map<std::string, uint64_t> live_;  // id -> request_id, queued or running
    uint64_t last_request_id_ = 0;
    bool closing_ = false;
    std::vector<std::thread> threads_;
};

int usage() {
    std::fprintf(stderr, "usage: specexport-service BUNDLE [--workers N] [--threads N] [--max-batch N] "
                         "[--settings JSON]\n");
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) return usage();
    std::string bundle = argv[1];
    specexport::OpenOptions options;
    int workers = 4;
    for (int i = 2; i < argc; i += 2) {
        std::string flag = argv[i];
        if (i + 1 >= argc) return usage();
        if (flag == "--workers") workers = std::max(1, std::atoi(argv[i + 1]));
        else if (flag == "--threads") options.threads = std::atoi(argv[i + 1]);
        else if (flag == "--max-batch") options.max_batch = std::atoi(argv[i + 1]);
        else if (flag == "--settings") options.settings = argv[i + 1];
        else return usage();
    }
    try {
        auto start = std::chrono::steady_clock::now();
        specexport::Engine engine(bundle, options);
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "specexport-service: %s loaded in %.2f s (specexport %s), %d workers\n", bundle.c_str(),
                     seconds, specexport::version().c_str(), workers);
        Service service(engine, workers);
        std::string line;
        while (std::getline(std::cin, line)) {
            if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
            json::Value request;
            try {
                request = json::parse(line);
            } catch (const std::runtime_error& e) {
                emit_error("null", e.what(), "invalid_request");
                continue;
            }
            const json::Value* id = request.get("id");
            try {
                if (const json::Value* cancel = request.get("cancel")) service.cancel(cancel->raw);
                else if (id == nullptr) emit_error("null", "a request needs an id", "invalid_request");
                else service.submit({id->raw, parse_options(request)});
            } catch (const std::runtime_error& e) {
                emit_error(id != nullptr ? id->raw : "null", e.what(), "invalid_request");
            }
        }
        service.finish();
    } catch (const specexport::Error& e) {
        std::fprintf(stderr, "specexport-service: %s (%s)\n", e.what(), e.status_name());
        return 1;
    }
    return 0;
}
