/// A call the model wrote, `call:NAME{key:value,...}`, read back into JSON: bare keys (or delimited ones), strings
/// between <|"|> delimiters, numbers, true/false/null, nested {...} and [...] (gemma_ane/runtime/gemma4.py's
/// parse_call). Nesting is bounded, so a hostile output cannot exhaust the stack.
enum GemmaCall {
    static let maxDepth = 64
    static let q = Array("<|\"|>".unicodeScalars)

    struct Failure: Error { let message: String }

    static func parse(_ text: String) throws -> (name: String, arguments: JSONValue) {
        let s = Array(text.unicodeScalars)
        let prefix = Array("call:".unicodeScalars)
        guard s.starts(with: prefix) else { throw Failure(message: "expected call:NAME{...}") }
        var i = prefix.count
        while i < s.count, isNameCharacter(s[i]) { i += 1 }
        guard i > prefix.count, i < s.count, s[i] == "{" else { throw Failure(message: "expected call:NAME{...}") }
        let name = OutputParser.string(s[prefix.count..<i])
        var reader = Reader(s: s, i: i)
        let arguments = try reader.object(depth: 0)
        guard reader.i == s.count else { throw Failure(message: "text after the arguments") }
        return (name, arguments)
    }

    /// `[\w.:-]`: Python's \w is letters, digits (any script) and the underscore.
    static func isNameCharacter(_ c: Unicode.Scalar) -> Bool {
        c == "_" || c == "." || c == ":" || c == "-" || c.properties.isAlphabetic || c.properties.numericType != nil
            || c.properties.generalCategory == .decimalNumber
    }

    struct Reader {
        let s: [Unicode.Scalar]
        var i: Int

        func at(_ token: [Unicode.Scalar]) -> Bool {
            i + token.count <= s.count && s[i..<(i + token.count)].elementsEqual(token)
        }

        func at(_ c: Unicode.Scalar) -> Bool { i < s.count && s[i] == c }

        mutating func object(depth: Int) throws -> JSONValue {
            guard depth < maxDepth else { throw Failure(message: "arguments nested too deeply") }
            i += 1  // past "{"
            var members = [JSONValue.Member]()
            if at("}") {
                i += 1
                return .object(members)
            }
            while true {
                let key: String
                if at(q) {
                    key = try string()
                } else {
                    let start = i
                    while i < s.count, !":{}[],".unicodeScalars.contains(s[i]) { i += 1 }
                    guard i > start else { throw Failure(message: "expected a key at \(start)") }
                    key = OutputParser.string(s[start..<i])
                }
                guard at(":") else { throw Failure(message: "expected ':' at \(i)") }
                i += 1
                let v = try value(depth: depth)
                members.removeAll { $0.key == key }  // a repeated key: the last wins, as in a Python dict
                members.append(JSONValue.Member(key, v))
                if at("}") {
                    i += 1
                    return .object(members)
                }
                guard at(",") else { throw Failure(message: "expected ',' or '}' at \(i)") }
                i += 1
            }
        }

        mutating func array(depth: Int) throws -> JSONValue {
            guard depth < maxDepth else { throw Failure(message: "arguments nested too deeply") }
            i += 1  // past "["
            var items = [JSONValue]()
            if at("]") {
                i += 1
                return .array(items)
            }
            while true {
                items.append(try value(depth: depth))
                if at("]") {
                    i += 1
                    return .array(items)
                }
                guard at(",") else { throw Failure(message: "expected ',' or ']' at \(i)") }
                i += 1
            }
        }

        mutating func string() throws -> String {
            let start = i + q.count
            var j = start
            while j + q.count <= s.count {
                if s[j..<(j + q.count)].elementsEqual(q) {
                    i = j + q.count
                    return OutputParser.string(s[start..<j])
                }
                j += 1
            }
            throw Failure(message: "the string at \(i) is never closed")
        }

        mutating func value(depth: Int) throws -> JSONValue {
            if at(q) { return .string(try string()) }
            if at("{") { return try object(depth: depth + 1) }
            if at("[") { return try array(depth: depth + 1) }
            for (word, v) in [("true", JSONValue.bool(true)), ("false", .bool(false)), ("null", .null)]
            where at(Array(word.unicodeScalars)) {
                i += word.unicodeScalars.count
                return v
            }
            if let (number, end) = Self.number(s, i) {
                i = end
                return number
            }
            throw Failure(message: "expected a value at \(i)")
        }

        /// `-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?`: an int without '.', 'e' or 'E', else a finite double.
        static func number(_ s: [Unicode.Scalar], _ start: Int) -> (JSONValue, Int)? {
            func digits(_ j: Int) -> Int {
                var k = j
                while k < s.count, ("0"..."9").contains(s[k]) { k += 1 }
                return k
            }
            var j = start
            if j < s.count, s[j] == "-" { j += 1 }
            let intEnd = digits(j)
            if intEnd > j {
                j = intEnd
                if j < s.count, s[j] == "." { j = digits(j + 1) }
            } else if j < s.count, s[j] == ".", digits(j + 1) > j + 1 {
                j = digits(j + 1)
            } else {
                return nil
            }
            if j < s.count, s[j] == "e" || s[j] == "E" {
                var k = j + 1
                if k < s.count, s[k] == "+" || s[k] == "-" { k += 1 }
                if digits(k) > k { j = digits(k) }
            }
            let text = OutputParser.string(s[start..<j])
            if !text.contains(where: { ".eE".contains($0) }), let int = Int(text) { return (.int(int), j) }
            guard let double = Double(text), double.isFinite else { return nil }
            return (.double(double), j)
        }
    }
}
