import Foundation

/// A JSON value as tool declarations, call arguments and tool results carry it. Objects keep their members'
/// order (Gemma's format sorts keys itself); integers and doubles stay apart, as Python prints them apart.
public indirect enum JSONValue: Sendable, Equatable {
    case null
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case array([JSONValue])
    case object([Member])

    public struct Member: Sendable, Equatable {
        public var key: String
        public var value: JSONValue
        public init(_ key: String, _ value: JSONValue) {
            self.key = key
            self.value = value
        }
    }

    /// A value as Foundation's JSONSerialization decodes it (booleans told from numbers).
    public init(foundation value: Any) throws {
        switch value {
        case is NSNull: self = .null
        case let number as NSNumber:
            if isBoolean(number) {
                self = .bool(number.boolValue)
            } else if String(cString: number.objCType) == "d" || String(cString: number.objCType) == "f" {
                self = .double(number.doubleValue)
            } else {
                self = .int(number.intValue)
            }
        case let text as String: self = .string(text)
        case let list as [Any]: self = .array(try list.map { try JSONValue(foundation: $0) })
        case let object as [String: Any]:
            self = .object(try object.keys.sorted().map { Member($0, try JSONValue(foundation: object[$0]!)) })
        default:
            throw GemmaANEError(.input, "not a JSON value: \(type(of: value))")
        }
    }

    /// An object's member, nil for a missing one or a non-object.
    public subscript(key: String) -> JSONValue? {
        guard case .object(let members) = self else { return nil }
        return members.last { $0.key == key }?.value
    }

    var string: String? {
        if case .string(let s) = self { return s }
        return nil
    }

    var int: Int? {
        if case .int(let v) = self { return v }
        return nil
    }

    var bool: Bool? {
        if case .bool(let v) = self { return v }
        return nil
    }

    var array: [JSONValue]? {
        if case .array(let v) = self { return v }
        return nil
    }

    var number: Double? {
        switch self {
        case .int(let v): return Double(v)
        case .double(let v): return v
        default: return nil
        }
    }

    var members: [Member]? {
        if case .object(let m) = self { return m }
        return nil
    }

    /// Jinja's truth: empty strings, lists and objects, 0, false and null are false.
    var truthy: Bool {
        switch self {
        case .null: return false
        case .bool(let b): return b
        case .int(let i): return i != 0
        case .double(let d): return d != 0
        case .string(let s): return !s.isEmpty
        case .array(let a): return !a.isEmpty
        case .object(let o): return !o.isEmpty
        }
    }

    /// Every string in the value, keys included, changed by `f` (the chat format's escaping).
    func mapStrings(_ f: (String) -> String) -> JSONValue {
        switch self {
        case .string(let s): return .string(f(s))
        case .array(let a): return .array(a.map { $0.mapStrings(f) })
        case .object(let o): return .object(o.map { Member(f($0.key), $0.value.mapStrings(f)) })
        default: return self
        }
    }

    func forEachString(_ f: (String) -> Void) {
        switch self {
        case .string(let s): f(s)
        case .array(let a): a.forEach { $0.forEachString(f) }
        case .object(let o): o.forEach { f($0.key); $0.value.forEachString(f) }
        default: break
        }
    }

    /// The value as Python's `str()` prints it inside Jinja (`True`, `None`, `{'a': 1}`), for the rare schema
    /// field the format prints raw.
    var pythonText: String {
        switch self {
        case .null: return "None"
        case .bool(let b): return b ? "True" : "False"
        case .int(let i): return String(i)
        case .double(let d): return pythonRepr(d)
        case .string(let s): return s
        case .array(let a): return "[" + a.map(\.pythonRepresentation).joined(separator: ", ") + "]"
        case .object(let o): return "{" + o.map { "'\($0.key)': \($0.value.pythonRepresentation)" }.joined(separator: ", ") + "}"
        }
    }

    private var pythonRepresentation: String {
        if case .string(let s) = self { return "'" + s + "'" }
        return pythonText
    }
}

/// Python's `repr(float)`: the shortest digits that read back, fixed between 1e-4 and 1e16, else scientific with
/// a two-digit exponent at least (`1e-05`, `1e+16`); Swift's own description switches at other places.
func pythonRepr(_ value: Double) -> String {
    if value.isNaN { return "nan" }
    if value.isInfinite { return value < 0 ? "-inf" : "inf" }
    if value == 0 { return value.sign == .minus ? "-0.0" : "0.0" }
    // Swift's description has the shortest round-trip digits; take them apart and lay them out Python's way.
    let text = "\(abs(value))"
    var mantissa = text, exponent = 0
    if let e = text.firstIndex(where: { $0 == "e" || $0 == "E" }) {
        mantissa = String(text[..<e])
        exponent = Int(text[text.index(after: e)...])!
    }
    let parts = mantissa.split(separator: ".", omittingEmptySubsequences: false)
    let whole = String(parts[0]), fraction = parts.count > 1 ? String(parts[1]) : ""
    var digits = whole + fraction
    var point = whole.count + exponent  // the decimal point's place after digits[0...]
    while digits.hasPrefix("0") && digits.count > 1 {
        digits.removeFirst()
        point -= 1
    }
    while digits.hasSuffix("0") && digits.count > 1 { digits.removeLast() }
    let decimalExponent = point - 1
    let sign = value < 0 ? "-" : ""
    if decimalExponent < -4 || decimalExponent >= 16 {
        let rest = digits.dropFirst()
        let e = decimalExponent < 0 ? "-" : "+"
        let magnitude = abs(decimalExponent)
        return sign + String(digits.first!) + (rest.isEmpty ? "" : "." + rest) + "e" + e + (magnitude < 10 ? "0" : "") + String(magnitude)
    }
    if point <= 0 { return sign + "0." + String(repeating: "0", count: -point) + digits }
    if point >= digits.count { return sign + digits + String(repeating: "0", count: point - digits.count) + ".0" }
    let cut = digits.index(digits.startIndex, offsetBy: point)
    return sign + digits[..<cut] + "." + digits[cut...]
}
