// json.hpp: just enough JSON for the example service (one request per line in, one response per line out), so
// that the example needs nothing but the standard library. A real service would use its own JSON library.
#ifndef SPECEXPORT_EXAMPLE_JSON_HPP
#define SPECEXPORT_EXAMPLE_JSON_HPP

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace json {

struct Value {
    enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
    bool boolean = false;
    double number = 0;
    std::string text;   // String; for any value, `raw` below is its JSON
    std::string raw;    // the value's source text (echoing an id as the client wrote it)
    std::vector<Value> items;
    std::vector<std::pair<std::string, Value>> members;

    const Value* get(const std::string& key) const {
        for (const auto& [k, v] : members)
            if (k == key) return &v;
        return nullptr;
    }
};

class Parser {
public:
    explicit Parser(const std::string& s) : s_(s) {}

    Value parse() {
        Value v = value();
        space();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

private:
    [[noreturn]] void fail(const char* what) const {
        throw std::runtime_error(std::string("invalid JSON: ") + what + " at offset " + std::to_string(i_));
    }
    void space() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\r' || s_[i_] == '\n')) i_++;
    }
    bool eat(char c) {
        space();
        if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
        return false;
    }
    bool word(const char* w) {
        size_t n = std::char_traits<char>::length(w);
        if (s_.compare(i_, n, w) != 0) return false;
        i_ += n;
        return true;
    }
    Value value() {
        space();
        size_t start = i_;
        Value v;
        if (eat('{')) {
            v.kind = Value::Object;
            if (!eat('}')) {
                do {
                    space();
                    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a key");
                    std::string key = string();
                    if (!eat(':')) fail("expected ':'");
                    v.members.emplace_back(std::move(key), value());
                } while (eat(','));
                if (!eat('}')) fail("expected '}'");
            }
        } else if (eat('[')) {
            v.kind = Value::Array;
            if (!eat(']')) {
                do v.items.push_back(value());
                while (eat(','));
                if (!eat(']')) fail("expected ']'");
            }
        } else if (i_ < s_.size() && s_[i_] == '"') {
            v.kind = Value::String, v.text = string();
        } else if (word("true") || word("false")) {
            v.kind = Value::Bool, v.boolean = s_[start] == 't';
        } else if (word("null")) {
            v.kind = Value::Null;
        } else {
            size_t used = 0;
            try {
                v.number = std::stod(s_.substr(i_), &used);
            } catch (const std::exception&) {
                fail("expected a value");
            }
            v.kind = Value::Number, i_ += used;
        }
        v.raw = s_.substr(start, i_ - start);
        return v;
    }
    std::string string() {  // at the opening quote
        std::string out;
        for (i_++; i_ < s_.size() && s_[i_] != '"'; i_++) {
            if (s_[i_] != '\\') {
                out += s_[i_];
                continue;
            }
            if (++i_ >= s_.size()) fail("unfinished escape");
            switch (char c = s_[i_]) {
                case 'n': out += '\n'; break;
                case 't': out += '\t'; break;
                case 'r': out += '\r'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'u': utf8(out, codepoint()); break;
                default: out += c;  // \" \\ \/
            }
        }
        if (i_++ >= s_.size()) fail("unfinished string");
        return out;
    }
    uint32_t hex4() {
        if (i_ + 4 >= s_.size()) fail("short \\u escape");
        uint32_t v = static_cast<uint32_t>(std::stoul(s_.substr(i_ + 1, 4), nullptr, 16));
        i_ += 4;
        return v;
    }
    uint32_t codepoint() {
        uint32_t c = hex4();
        if (c >= 0xD800 && c < 0xDC00 && s_.compare(i_ + 1, 2, "\\u") == 0) {  // a surrogate pair
            i_ += 2;
            c = 0x10000 + ((c - 0xD800) << 10) + (hex4() - 0xDC00);
        }
        return c;
    }
    static void utf8(std::string& out, uint32_t c) {
        if (c < 0x80) {
            out += static_cast<char>(c);
        } else if (c < 0x800) {
            out += static_cast<char>(0xC0 | (c >> 6)), out += static_cast<char>(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            out += static_cast<char>(0xE0 | (c >> 12)), out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (c & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (c >> 18)), out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((c >> 6) & 0x3F)), out += static_cast<char>(0x80 | (c & 0x3F));
        }
    }

    const std::string& s_;
    size_t i_ = 0;
};

inline Value parse(const std::string& s) { return Parser(s).parse(); }

// A JSON string literal of UTF-8 text.
inline std::string quote(std::string_view s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\', out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out + "\"";
}

}  // namespace json

#endif
