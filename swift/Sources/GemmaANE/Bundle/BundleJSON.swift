import Foundation

/// A JSON value as a bundle's files hold it, with integers kept apart from floats and booleans
/// (the Python schema's `_integer` refuses `true` and `1.5` where it wants an integer).
public indirect enum BundleJSON: Decodable, Equatable, Sendable {
    case null
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case array([BundleJSON])
    case object([String: BundleJSON])

    public init(from decoder: Decoder) throws {
        let c = try decoder.singleValueContainer()
        if c.decodeNil() {
            self = .null
        } else if let b = try? c.decode(Bool.self) {
            self = .bool(b)
        } else if let i = try? c.decode(Int.self) {
            self = .int(i)
        } else if let d = try? c.decode(Double.self) {
            self = .double(d)
        } else if let s = try? c.decode(String.self) {
            self = .string(s)
        } else if let a = try? c.decode([BundleJSON].self) {
            self = .array(a)
        } else {
            self = .object(try c.decode([String: BundleJSON].self))
        }
    }

    /// An integer that is no boolean (JSON's `2`, never `2.0` or `true`).
    public var int: Int? { if case .int(let i) = self { return i } else { return nil } }
    /// Any number that is no boolean.
    public var number: Double? {
        switch self {
        case .int(let i): return Double(i)
        case .double(let d): return d
        default: return nil
        }
    }
    public var string: String? { if case .string(let s) = self { return s } else { return nil } }
    public var array: [BundleJSON]? { if case .array(let a) = self { return a } else { return nil } }
    public var object: [String: BundleJSON]? { if case .object(let o) = self { return o } else { return nil } }

    /// Foundation's form of the value (Int, Double, Bool, String, NSNull, arrays, dictionaries), for
    /// readers that take `[String: Any]`.
    public var any: Any {
        switch self {
        case .null: return NSNull()
        case .bool(let b): return b
        case .int(let i): return i
        case .double(let d): return d
        case .string(let s): return s
        case .array(let a): return a.map(\.any)
        case .object(let o): return o.mapValues(\.any)
        }
    }

    /// The value as the Python package's messages quote it (`repr`, cut at 40 characters as `schema._short` cuts).
    public var short: String {
        let text = repr
        return text.count <= 40 ? text : String(text.prefix(37)) + "..."
    }

    private var repr: String {
        switch self {
        case .null: return "None"
        case .bool(let b): return b ? "True" : "False"
        case .int(let i): return String(i)
        case .double(let d): return d == d.rounded() && abs(d) < 1e16 ? String(format: "%.1f", d) : "\(d)"
        case .string(let s): return "'\(s)'"
        case .array(let a): return "[" + a.map(\.repr).joined(separator: ", ") + "]"
        case .object(let o): return "{" + o.keys.sorted().map { "'\($0)': \(o[$0]?.repr ?? "")" }.joined(separator: ", ") + "}"
        }
    }
}

/// The largest JSON file of a bundle read here (configs and manifests are kilobytes; a bigger one is damage).
let maxJSONBytes = 64 << 20

/// A bundle's JSON object at `url`: a missing, oversized, unparsable or non-object file is one `.bundle` error
/// naming the file.
func readJSONObject(_ url: URL) throws -> [String: BundleJSON] {
    let data = try readBoundedFile(url, limit: maxJSONBytes)
    let value: BundleJSON
    do {
        value = try JSONDecoder().decode(BundleJSON.self, from: data)
    } catch {
        throw GemmaANEError(.bundle, "\(url.path): not valid JSON")
    }
    guard let object = value.object else {
        throw GemmaANEError(.bundle, "\(url.path): expected a JSON object")
    }
    return object
}

/// The whole of a small file, refused past `limit` bytes before anything is read.
func readBoundedFile(_ url: URL, limit: Int) throws -> Data {
    let size = try fileSize(url)
    guard size <= limit else {
        throw GemmaANEError(.bundle, "\(url.path): \(size) bytes, at most \(limit) expected")
    }
    do {
        return try Data(contentsOf: url)
    } catch {
        throw GemmaANEError(.bundle, "\(url.path): unreadable")
    }
}

/// A regular file's size, or one `.bundle` error saying it is missing.
func fileSize(_ url: URL) throws -> Int {
    var isDirectory: ObjCBool = false
    guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), !isDirectory.boolValue,
        let attributes = try? FileManager.default.attributesOfItem(atPath: url.path),
        let size = (attributes[.size] as? NSNumber)?.intValue
    else {
        throw GemmaANEError(.bundle, "\(url.path): missing")
    }
    return size
}
