/// A JSON reader straight from UTF-8 bytes into `JSONValue`: a tokenizer.json of the real size (262,144 pieces and
/// as many merges, ~25 MB) loads in a fraction of what Foundation's JSONSerialization takes building bridged
/// objects. Nesting is bounded, so a hostile file cannot exhaust the stack.
struct JSONReader {
    struct Failure: Error {
        let offset: Int
        let why: String
    }

    static let maxDepth = 512

    private let bytes: UnsafeBufferPointer<UInt8>
    private var i = 0

    /// The one value `bytes` hold (whitespace around it allowed).
    static func parse(_ bytes: UnsafeBufferPointer<UInt8>) throws -> JSONValue {
        var reader = JSONReader(bytes: bytes)
        var start = 0
        if bytes.count >= 3, bytes[0] == 0xEF, bytes[1] == 0xBB, bytes[2] == 0xBF { start = 3 }  // a UTF-8 BOM
        reader.i = start
        reader.skipSpace()
        let value = try reader.value(depth: 0)
        reader.skipSpace()
        guard reader.i == bytes.count else { throw Failure(offset: reader.i, why: "text after the value") }
        return value
    }

    private init(bytes: UnsafeBufferPointer<UInt8>) {
        self.bytes = bytes
    }

    private mutating func skipSpace() {
        while i < bytes.count, bytes[i] == 0x20 || bytes[i] == 0x0A || bytes[i] == 0x0D || bytes[i] == 0x09 { i += 1 }
    }

    private func fail(_ why: String) -> Failure { Failure(offset: i, why: why) }

    private mutating func expect(_ word: StaticString, _ value: JSONValue) throws -> JSONValue {
        let n = word.utf8CodeUnitCount
        guard i + n <= bytes.count else { throw fail("unexpected end") }
        for k in 0..<n where bytes[i + k] != word.utf8Start[k] { throw fail("unexpected character") }
        i += n
        return value
    }

    private mutating func value(depth: Int) throws -> JSONValue {
        guard depth < Self.maxDepth else { throw fail("nested more than \(Self.maxDepth) deep") }
        guard i < bytes.count else { throw fail("unexpected end") }
        switch bytes[i] {
        case UInt8(ascii: "{"):
            i += 1
            var members = [JSONValue.Member]()
            skipSpace()
            if i < bytes.count, bytes[i] == UInt8(ascii: "}") {
                i += 1
                return .object(members)
            }
            while true {
                skipSpace()
                guard i < bytes.count, bytes[i] == UInt8(ascii: "\"") else { throw fail("expected a key") }
                let key = try string()
                skipSpace()
                guard i < bytes.count, bytes[i] == UInt8(ascii: ":") else { throw fail("expected ':'") }
                i += 1
                skipSpace()
                members.append(JSONValue.Member(key, try value(depth: depth + 1)))
                skipSpace()
                guard i < bytes.count else { throw fail("unexpected end") }
                if bytes[i] == UInt8(ascii: "}") {
                    i += 1
                    return .object(members)
                }
                guard bytes[i] == UInt8(ascii: ",") else { throw fail("expected ',' or '}'") }
                i += 1
            }
        case UInt8(ascii: "["):
            i += 1
            var items = [JSONValue]()
            skipSpace()
            if i < bytes.count, bytes[i] == UInt8(ascii: "]") {
                i += 1
                return .array(items)
            }
            while true {
                skipSpace()
                items.append(try value(depth: depth + 1))
                skipSpace()
                guard i < bytes.count else { throw fail("unexpected end") }
                if bytes[i] == UInt8(ascii: "]") {
                    i += 1
                    return .array(items)
                }
                guard bytes[i] == UInt8(ascii: ",") else { throw fail("expected ',' or ']'") }
                i += 1
            }
        case UInt8(ascii: "\""): return .string(try string())
        case UInt8(ascii: "t"): return try expect("true", .bool(true))
        case UInt8(ascii: "f"): return try expect("false", .bool(false))
        case UInt8(ascii: "n"): return try expect("null", .null)
        default: return try number()
        }
    }

    private mutating func number() throws -> JSONValue {
        let start = i
        var integral = true
        while i < bytes.count {
            let b = bytes[i]
            if (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(b) || b == UInt8(ascii: "-") {
                i += 1
            } else if b == UInt8(ascii: ".") || b == UInt8(ascii: "e") || b == UInt8(ascii: "E") || b == UInt8(ascii: "+") {
                integral = false
                i += 1
            } else {
                break
            }
        }
        let text = String(decoding: UnsafeBufferPointer(rebasing: bytes[start..<i]), as: UTF8.self)
        if integral, let int = Int(text) { return .int(int) }
        guard !text.isEmpty, let double = Double(text), double.isFinite else {
            i = start
            throw fail("expected a value")
        }
        return .double(double)
    }

    private mutating func string() throws -> String {
        i += 1  // past the opening quote
        let start = i
        while i < bytes.count, bytes[i] != UInt8(ascii: "\""), bytes[i] != UInt8(ascii: "\\") { i += 1 }
        guard i < bytes.count else { throw fail("a string never closed") }
        if bytes[i] == UInt8(ascii: "\"") {  // no escapes: the common case, one copy
            let text = String(decoding: UnsafeBufferPointer(rebasing: bytes[start..<i]), as: UTF8.self)
            i += 1
            return text
        }
        var out = Array(bytes[start..<i])
        while i < bytes.count {
            let byte = bytes[i]
            if byte == UInt8(ascii: "\"") {
                i += 1
                return String(decoding: out, as: UTF8.self)
            }
            if byte != UInt8(ascii: "\\") {
                out.append(byte)
                i += 1
                continue
            }
            guard i + 1 < bytes.count else { break }
            let escape = bytes[i + 1]
            i += 2
            switch escape {
            case UInt8(ascii: "n"): out.append(0x0A)
            case UInt8(ascii: "t"): out.append(0x09)
            case UInt8(ascii: "r"): out.append(0x0D)
            case UInt8(ascii: "b"): out.append(0x08)
            case UInt8(ascii: "f"): out.append(0x0C)
            case UInt8(ascii: "/"), UInt8(ascii: "\\"), UInt8(ascii: "\""): out.append(escape)
            case UInt8(ascii: "u"):
                var scalar = try hex4()
                if (0xD800..<0xDC00).contains(scalar), i + 1 < bytes.count, bytes[i] == UInt8(ascii: "\\"),
                    bytes[i + 1] == UInt8(ascii: "u")
                {
                    let save = i
                    i += 2
                    let low = try hex4()
                    if (0xDC00..<0xE000).contains(low) {
                        scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                    } else {
                        i = save
                    }
                }
                // a lone surrogate is no character: U+FFFD, as Python's json reads it into text it cannot encode
                out += Array(String(Unicode.Scalar(scalar) ?? "\u{FFFD}").utf8)
            default: throw fail("a bad escape")
            }
        }
        throw fail("a string never closed")
    }

    private mutating func hex4() throws -> UInt32 {
        guard i + 4 <= bytes.count,
            let value = UInt32(String(decoding: UnsafeBufferPointer(rebasing: bytes[i..<(i + 4)]), as: UTF8.self), radix: 16)
        else { throw fail("a bad \\u escape") }
        i += 4
        return value
    }
}
